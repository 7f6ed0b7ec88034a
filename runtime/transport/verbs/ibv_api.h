// IbvApi: the one function table through which gradsync reaches libibverbs.
//
// Production code never calls ibv_* directly. The table is filled either by
// load_libibverbs() (dlopen of libibverbs.so.1, so the build does not link -libverbs and the
// binary starts on machines without rdma-core) or by emulated_ibv() (an in-process test
// fabric, emulated_fabric.h). post_send, post_recv and poll_cq are static inline in verbs.h
// (they dispatch through ctx->ops), so the table carries its own entries for them.
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>

#include "gradsync/status.h"

namespace gradsync::verbs {

struct IbvApi {
  const char* name;  // "libibverbs.so.1" or "emulated": shown in logs and errors

  ibv_device** (*get_device_list)(int* num_devices);
  void (*free_device_list)(ibv_device** list);
  const char* (*get_device_name)(ibv_device* device);
  ibv_context* (*open_device)(ibv_device* device);
  int (*close_device)(ibv_context* context);
  int (*query_device)(ibv_context* context, ibv_device_attr* attr);
  // Takes the full ibv_port_attr (verbs.h's inline ibv_query_port hides a compat symbol).
  int (*query_port)(ibv_context* context, uint8_t port, ibv_port_attr* attr);
  int (*query_gid)(ibv_context* context, uint8_t port, int index, ibv_gid* gid);
  // May be null (rdma-core < 32): then the GID type (RoCE v1/v2) cannot be read.
  int (*query_gid_ex)(ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                      uint32_t flags);
  ibv_pd* (*alloc_pd)(ibv_context* context);
  int (*dealloc_pd)(ibv_pd* pd);
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access);
  int (*dereg_mr)(ibv_mr* mr);
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context,
                       ibv_comp_channel* channel, int comp_vector);
  int (*destroy_cq)(ibv_cq* cq);
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  int (*destroy_qp)(ibv_qp* qp);
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask);
  const char* (*wc_status_str)(ibv_wc_status status);

  // Data path (inline in verbs.h; here real functions).
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc);

  // Optional: ibv_reg_dmabuf_mr (rdma-core >= 34, IBVERBS_1.12), the registration of GPU
  // memory exported as a dma-buf fd. Null when the library lacks it; reg_dmabuf_mr_missing
  // then says why (for logs and errors), and is null while the entry is there.
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                           int access);
  const char* reg_dmabuf_mr_missing;
};

// dlopen("libibverbs.so.1") once per process and resolve every entry. The handle stays open
// for the life of the process. Fails with kUnavailable naming the library or the missing
// symbol, so the caller can log it and fall back to TCP.
Result<const IbvApi*> load_libibverbs();

}  // namespace gradsync::verbs
