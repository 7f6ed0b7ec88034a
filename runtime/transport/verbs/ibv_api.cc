#include "transport/verbs/ibv_api.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>

#include "common/dlsym.h"

namespace gradsync::verbs {
namespace {

constexpr const char* kLibName = "libibverbs.so.1";

// Symbols resolved from the library that the table does not expose with the same signature.
using CompatQueryPortFn = int (*)(ibv_context*, uint8_t, _compat_ibv_port_attr*);
using QueryGidExFn = int (*)(ibv_context*, uint32_t, uint32_t, ibv_gid_entry*, uint32_t, size_t);
CompatQueryPortFn g_compat_query_port = nullptr;
QueryGidExFn g_query_gid_ex = nullptr;

// Same logic as verbs.h's inline ___ibv_query_port: new providers answer through the
// extended context op; old ones through the exported (compat-struct) symbol.
int real_query_port(ibv_context* context, uint8_t port, ibv_port_attr* attr) {
  verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx == nullptr) {
    std::memset(attr, 0, sizeof(*attr));
    return g_compat_query_port(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
  }
  return vctx->query_port(context, port, attr, sizeof(*attr));
}

int real_query_gid_ex(ibv_context* context, uint32_t port, uint32_t index, ibv_gid_entry* entry,
                      uint32_t flags) {
  return g_query_gid_ex(context, port, index, entry, flags, sizeof(*entry));
}

// The inline dispatchers of verbs.h, made addressable.
int real_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  return qp->context->ops.post_send(qp, wr, bad_wr);
}
int real_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  return qp->context->ops.post_recv(qp, wr, bad_wr);
}
int real_poll_cq(ibv_cq* cq, int num_entries, ibv_wc* wc) {
  return cq->context->ops.poll_cq(cq, num_entries, wc);
}

Result<const IbvApi*> load_once() {
  void* handle = dlopen(kLibName, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status(Code::kUnavailable,
                  std::string(kLibName) + " not found: install rdma-core (libibverbs1); " +
                      "falling back to TCP (dlopen: " + (why ? why : "unknown error") + ")");
  }
  static IbvApi api{};
  api.name = kLibName;
  std::string missing;
  resolve_symbol(handle, "ibv_get_device_list", api.get_device_list, missing);
  resolve_symbol(handle, "ibv_free_device_list", api.free_device_list, missing);
  resolve_symbol(handle, "ibv_get_device_name", api.get_device_name, missing);
  resolve_symbol(handle, "ibv_open_device", api.open_device, missing);
  resolve_symbol(handle, "ibv_close_device", api.close_device, missing);
  resolve_symbol(handle, "ibv_query_device", api.query_device, missing);
  resolve_symbol(handle, "ibv_query_port", g_compat_query_port, missing);
  resolve_symbol(handle, "ibv_query_gid", api.query_gid, missing);
  resolve_symbol(handle, "ibv_alloc_pd", api.alloc_pd, missing);
  resolve_symbol(handle, "ibv_dealloc_pd", api.dealloc_pd, missing);
  resolve_symbol(handle, "ibv_reg_mr", api.reg_mr, missing);
  resolve_symbol(handle, "ibv_dereg_mr", api.dereg_mr, missing);
  resolve_symbol(handle, "ibv_create_cq", api.create_cq, missing);
  resolve_symbol(handle, "ibv_destroy_cq", api.destroy_cq, missing);
  resolve_symbol(handle, "ibv_create_qp", api.create_qp, missing);
  resolve_symbol(handle, "ibv_destroy_qp", api.destroy_qp, missing);
  resolve_symbol(handle, "ibv_modify_qp", api.modify_qp, missing);
  resolve_symbol(handle, "ibv_wc_status_str", api.wc_status_str, missing);
  if (!missing.empty()) {
    dlclose(handle);
    return Status(Code::kUnavailable, std::string(kLibName) + " lacks " + missing +
                                          ": rdma-core too old or broken; falling back to TCP");
  }
  // Optional: GID types need rdma-core >= 32.
  g_query_gid_ex = reinterpret_cast<QueryGidExFn>(dlsym(handle, "_ibv_query_gid_ex"));
  api.query_gid_ex = g_query_gid_ex ? &real_query_gid_ex : nullptr;
  // Optional: dma-buf registration (GPU memory) needs rdma-core >= 34.
  api.reg_dmabuf_mr =
      reinterpret_cast<decltype(api.reg_dmabuf_mr)>(dlsym(handle, "ibv_reg_dmabuf_mr"));
  api.reg_dmabuf_mr_missing =
      api.reg_dmabuf_mr ? nullptr
                        : "libibverbs.so.1 has no ibv_reg_dmabuf_mr (rdma-core < 34): GPU memory "
                          "cannot be registered by dma-buf";
  api.query_port = &real_query_port;
  api.post_send = &real_post_send;
  api.post_recv = &real_post_recv;
  api.poll_cq = &real_poll_cq;
  return static_cast<const IbvApi*>(&api);
}

}  // namespace

Result<const IbvApi*> load_libibverbs() {
  // Loaded once; a failure is remembered too (the library will not appear later).
  static Result<const IbvApi*> loaded = load_once();
  return loaded;
}

}  // namespace gradsync::verbs
