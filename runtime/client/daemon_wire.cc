#include "client/daemon_wire.h"

#include <pb_decode.h>
#include <pb_encode.h>

#include <type_traits>

#include "common/limits.h"
#include "topology/rail_devices.h"
#include "daemon.nanopb.h"  // generated at build time from proto/daemon.proto (CMakeLists.txt)

namespace gradsync::wire {
namespace {

// --- encoding: the callbacks that write a request's strings and lists -------------------

bool write_string(pb_ostream_t* s, const pb_field_t* f, void* const* arg) {
  const auto* str = static_cast<const std::string*>(*arg);
  if (str->empty()) return true;  // proto3 leaves empty strings out, as protobuf does
  return pb_encode_tag_for_field(s, f) &&
         pb_encode_string(s, reinterpret_cast<const pb_byte_t*>(str->data()), str->size());
}

// int32 elements, one tag each (unpacked: every protobuf parser takes both forms).
bool write_int32s(pb_ostream_t* s, const pb_field_t* f, void* const* arg) {
  for (int32_t v : *static_cast<const std::vector<int32_t>*>(*arg)) {
    // int32 is a sign-extended varint on the wire (not zig-zag, which is sint32's).
    if (!pb_encode_tag_for_field(s, f) || !pb_encode_varint(s, uint64_t(int64_t(v)))) return false;
  }
  return true;
}

pb_callback_t out(const std::string& s) {
  pb_callback_t c{};
  c.funcs.encode = write_string;
  c.arg = const_cast<std::string*>(&s);  // read only: write_string takes it as const
  return c;
}

pb_callback_t out(const std::vector<int32_t>& v) {
  pb_callback_t c{};
  c.funcs.encode = write_int32s;
  c.arg = const_cast<std::vector<int32_t>*>(&v);
  return c;
}

// --- decoding: bounded sinks for a reply's strings and lists -----------------------------

// What a callback needs to refuse a field: its name, its limit, and where the message goes.
struct Bound {
  std::string* error;
  const char* what;
  size_t max;
  bool refuse(pb_istream_t* s, size_t got, const char* unit) const {
    *error = std::string(what) + " has " + std::to_string(got) + " " + unit + ", above the limit of " +
             std::to_string(max);
    PB_RETURN_ERROR(s, "over a limit");
  }
};

template <class T>
struct Sink {
  Bound bound;
  T* out;
};

bool read_bytes(pb_istream_t* s, std::string* out, const Bound& b) {
  if (s->bytes_left > b.max) return b.refuse(s, s->bytes_left, "bytes");
  out->resize(s->bytes_left);
  return pb_read(s, reinterpret_cast<pb_byte_t*>(out->data()), out->size());
}

bool read_string(pb_istream_t* s, const pb_field_t*, void** arg) {
  auto* sink = static_cast<Sink<std::string>*>(*arg);
  return read_bytes(s, sink->out, sink->bound);
}

// A list's elements: each string, and each (packed or not) scalar, comes in its own call. The
// list's length is bounded by `count_max`; a string element's by the sink's bound.
struct StringList {
  Bound bound;
  size_t count_max;
  std::vector<std::string>* out;
};
bool read_string_list(pb_istream_t* s, const pb_field_t*, void** arg) {
  auto* sink = static_cast<StringList*>(*arg);
  if (sink->out->size() >= sink->count_max) {
    return Bound{sink->bound.error, sink->bound.what, sink->count_max}.refuse(s, sink->out->size() + 1, "entries");
  }
  return read_bytes(s, &sink->out->emplace_back(), sink->bound);
}

template <class T>
bool read_scalar_list(pb_istream_t* s, const pb_field_t*, void** arg) {
  static_assert(std::is_same_v<T, uint32_t> || std::is_same_v<T, int32_t>);
  auto* sink = static_cast<Sink<std::vector<T>>*>(*arg);
  if (sink->out->size() >= sink->bound.max) return sink->bound.refuse(s, sink->out->size() + 1, "entries");
  uint64_t v = 0;
  if (!pb_decode_varint(s, &v)) return false;
  // uint32 arrives as up to 5 bytes, int32 as a sign-extended 64-bit varint: the low 32 bits
  // are the value either way (what protobuf's own parser keeps).
  sink->out->push_back(static_cast<T>(static_cast<uint32_t>(v)));
  return true;
}

bool read_channel(pb_istream_t* s, const pb_field_t*, void** arg) {
  auto* sink = static_cast<Sink<std::vector<ChannelRef>>*>(*arg);
  if (sink->out->size() >= sink->bound.max) return sink->bound.refuse(s, sink->out->size() + 1, "entries");
  gradsync_v1_ChannelRef r = gradsync_v1_ChannelRef_init_zero;
  if (!pb_decode(s, gradsync_v1_ChannelRef_fields, &r)) return false;
  sink->out->push_back(ChannelRef{r.tag, r.peer, r.send, r.index, r.remote, r.socket});
  return true;
}

template <class T>
pb_callback_t in(Sink<T>& sink, bool (*fn)(pb_istream_t*, const pb_field_t*, void**)) {
  pb_callback_t c{};
  c.funcs.decode = fn;
  c.arg = &sink;
  return c;
}
pb_callback_t in(Sink<std::string>& sink) { return in(sink, read_string); }
pb_callback_t in(StringList& sink) {
  pb_callback_t c{};
  c.funcs.decode = read_string_list;
  c.arg = &sink;
  return c;
}

Status malformed(const char* what, const std::string& error, pb_istream_t* s) {
  return Status(Code::kInternal, std::string("malformed ") + what + " from gradsyncd (" +
                                     (error.empty() ? std::string(PB_GET_ERROR(s)) : error) +
                                     "); is the daemon of another version?");
}

// The ChannelSetup's sinks, armed on `msg`; they fill `out`.
struct SetupSinks {
  Sink<std::vector<ChannelRef>> channels;
  SetupSinks(std::string* error, ChannelSetup* out) : channels{{error, "channel setup", kMaxChannelRefs}, &out->channels} {}
  void arm(gradsync_v1_ChannelSetup* msg) { msg->channels = in(channels, read_channel); }
};

void copy_setup(const gradsync_v1_ChannelSetup& m, ChannelSetup* out) {
  out->shm_bytes = m.shm_bytes;
  out->slots = m.slots;
  out->slot_bytes = m.slot_bytes;
  out->num_channels = m.num_channels;
  out->rings = m.rings;
  out->recorders = m.recorders;
  out->recorder_entries = m.recorder_entries;
  out->recorder_index = m.recorder_index;
}

pb_istream_t input(std::string_view bytes) {
  return pb_istream_from_buffer(reinterpret_cast<const pb_byte_t*>(bytes.data()), bytes.size());
}

}  // namespace

Result<std::string> encode(const ClientMessage& msg) {
  gradsync_v1_ClientMessage m = gradsync_v1_ClientMessage_init_zero;
  if (const auto* a = std::get_if<AttachRequest>(&msg)) {
    m.has_attach = true;
    m.attach.pid = a->pid;
    m.attach.protocol_version = a->protocol_version;
  } else if (const auto* j = std::get_if<JoinRequest>(&msg)) {
    m.has_join = true;
    m.join.job_id = out(j->job_id);
    m.join.token = out(j->token);
    m.join.rank = j->rank;
    m.join.world_size = j->world_size;
    m.join.local_rank = j->local_rank;
    m.join.local_world_size = j->local_world_size;
    m.join.timeout_ms = j->timeout_ms;
  } else if (std::holds_alternative<LeaveRequest>(msg)) {
    m.has_leave = true;
  } else if (const auto* a = std::get_if<AbortRequest>(&msg)) {
    m.has_abort = true;
    m.abort.reason = out(a->reason);
    m.abort.failure = a->failure;
    m.abort.culprit = a->culprit;
  } else if (const auto* p = std::get_if<PathReport>(&msg)) {
    m.has_path = true;
    m.path.path = out(p->path);
    m.path.why = out(p->why);
    m.path.gpu_memory_bytes = p->gpu_memory_bytes;
    m.path.pinned_host_bytes = p->pinned_host_bytes;
  } else if (const auto* t = std::get_if<TraceDumpRequest>(&msg)) {
    m.has_trace_dump = true;
    m.trace_dump.reason = out(t->reason);
  } else if (const auto* r = std::get_if<RegroupRequest>(&msg)) {
    m.has_regroup = true;
    m.regroup.node_id = out(r->node_id);
    m.regroup.job_id = out(r->job_id);
    m.regroup.token = out(r->token);
    m.regroup.from_generation = r->from_generation;
    m.regroup.old_world_size = r->old_world_size;
    m.regroup.old_rank = r->old_rank;
    m.regroup.failed = out(r->failed);
    m.regroup.newcomer = r->newcomer;
    m.regroup.newcomers = r->newcomers;
    m.regroup.wait_ms = r->wait_ms;
  }
  size_t size = 0;
  if (!pb_get_encoded_size(&size, gradsync_v1_ClientMessage_fields, &m)) {
    return Status(Code::kInternal, "cannot size a request to gradsyncd");
  }
  std::string bytes(size, '\0');
  pb_ostream_t s = pb_ostream_from_buffer(reinterpret_cast<pb_byte_t*>(bytes.data()), bytes.size());
  if (!pb_encode(&s, gradsync_v1_ClientMessage_fields, &m) || s.bytes_written != size) {
    return Status(Code::kInternal, std::string("cannot encode a request to gradsyncd: ") + PB_GET_ERROR(&s));
  }
  return bytes;
}

Result<DaemonMessage> decode(std::string_view bytes) {
  std::string error;
  AttachResponse attach;
  JoinResponse join;
  VerbsDevice verbs;
  ErrorResponse err;
  RegroupResponse regroup;
  Sink<std::string> node_name{{&error, "attach.node_name", kMaxNameBytes}, &attach.node_name};
  Sink<std::string> hostname{{&error, "attach.hostname", kMaxNameBytes}, &attach.hostname};
  Sink<std::vector<uint32_t>> ring{{&error, "join.ring", kMaxWorldSize}, &join.ring};
  StringList rank_hosts{{&error, "join.rank_hosts", kMaxNameBytes}, kMaxWorldSize, &join.rank_hosts};
  SetupSinks setup(&error, &join.setup);
  Sink<std::string> device{{&error, "join.verbs.device", kMaxNameBytes}, &verbs.device};
  Sink<std::string> api{{&error, "join.verbs.api", kMaxNameBytes}, &verbs.api};
  StringList rail_devices{{&error, "join.verbs.rail_devices", topology::kMaxRailDeviceName},
                          topology::kMaxRailDevices, &verbs.rail_devices};
  Sink<std::vector<uint32_t>> rank_node{{&error, "join.rank_node", kMaxWorldSize}, &join.rank_node};
  Sink<std::string> data_host{{&error, "join.data_host", kMaxNameBytes}, &join.data_host};
  Sink<std::string> message{{&error, "error.message", kMaxErrorBytes}, &err.message};
  Sink<std::vector<int32_t>> old_ranks{{&error, "regroup.old_ranks", kMaxWorldSize}, &regroup.old_ranks};

  gradsync_v1_DaemonMessage m = gradsync_v1_DaemonMessage_init_zero;
  m.attach.node_name = in(node_name);
  m.attach.hostname = in(hostname);
  m.join.ring = in(ring, read_scalar_list<uint32_t>);
  m.join.rank_hosts = in(rank_hosts);
  setup.arm(&m.join.setup);
  m.join.verbs.device = in(device);
  m.join.verbs.api = in(api);
  m.join.verbs.rail_devices = in(rail_devices);
  m.join.rank_node = in(rank_node, read_scalar_list<uint32_t>);
  m.join.data_host = in(data_host);
  m.error.message = in(message);
  m.regroup.old_ranks = in(old_ranks, read_scalar_list<int32_t>);
  pb_istream_t s = input(bytes);
  if (!pb_decode(&s, gradsync_v1_DaemonMessage_fields, &m)) return malformed("reply", error, &s);

  const int bodies = int(m.has_attach) + int(m.has_join) + int(m.has_leave) + int(m.has_error) + int(m.has_regroup);
  if (bodies != 1) {
    return Status(Code::kInternal, "gradsyncd's reply carries " + std::to_string(bodies) +
                                       " bodies instead of one; is the daemon of another version?");
  }
  if (m.has_attach) {
    attach.protocol_version = m.attach.protocol_version;
    return DaemonMessage(std::move(attach));
  }
  if (m.has_join) {
    join.generation = m.join.generation;
    copy_setup(m.join.setup, &join.setup);
    if (m.join.has_verbs) {
      verbs.port = m.join.verbs.port;
      verbs.gid_index = m.join.verbs.gid_index;
      join.verbs = std::move(verbs);
    }
    return DaemonMessage(std::move(join));
  }
  if (m.has_leave) return DaemonMessage(LeaveResponse{});
  if (m.has_error) {
    err.code = m.error.code;
    return DaemonMessage(std::move(err));
  }
  regroup.generation = m.regroup.generation;
  regroup.world_size = m.regroup.world_size;
  regroup.rank = m.regroup.rank;
  regroup.local_rank = m.regroup.local_rank;
  regroup.local_world_size = m.regroup.local_world_size;
  return DaemonMessage(std::move(regroup));
}

Result<ChannelSetup> decode_channel_setup(std::string_view bytes) {
  std::string error;
  ChannelSetup setup;
  SetupSinks sinks(&error, &setup);
  gradsync_v1_ChannelSetup m = gradsync_v1_ChannelSetup_init_zero;
  sinks.arm(&m);
  pb_istream_t s = input(bytes);
  if (!pb_decode(&s, gradsync_v1_ChannelSetup_fields, &m)) return malformed("channel setup", error, &s);
  copy_setup(m, &setup);
  return setup;
}

}  // namespace gradsync::wire
