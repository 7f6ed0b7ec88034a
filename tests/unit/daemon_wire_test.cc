// The library's nanopb side of the daemon protocol (client/daemon_wire.h) against the daemon's
// protobuf classes: what one writes the other reads, field for field, and the library refuses
// replies that break its bounds.
#include "client/daemon_wire.h"

#include <gtest/gtest.h>

#include <string>

#include "common/limits.h"
#include "daemon.pb.h"
#include "topology/rail_devices.h"

namespace gradsync {
namespace {

v1::ClientMessage parsed(const wire::ClientMessage& msg) {
  auto bytes = wire::encode(msg);
  EXPECT_TRUE(bytes.ok()) << bytes.status().to_string();
  v1::ClientMessage out;
  EXPECT_TRUE(bytes.ok() && out.ParseFromString(*bytes));
  return out;
}

Result<wire::DaemonMessage> read(const v1::DaemonMessage& msg) { return wire::decode(msg.SerializeAsString()); }

TEST(DaemonWire, RequestsReadByTheDaemon) {
  v1::ClientMessage m = parsed(wire::AttachRequest{4242, 7});
  ASSERT_TRUE(m.has_attach());
  EXPECT_EQ(m.attach().pid(), 4242u);
  EXPECT_EQ(m.attach().protocol_version(), 7u);

  m = parsed(wire::JoinRequest{"job.1", "tok", 3, 8, 1, 4, 60000});
  ASSERT_TRUE(m.has_join());
  EXPECT_EQ(m.join().job_id(), "job.1");
  EXPECT_EQ(m.join().token(), "tok");
  EXPECT_EQ(m.join().rank(), 3u);
  EXPECT_EQ(m.join().world_size(), 8u);
  EXPECT_EQ(m.join().local_rank(), 1u);
  EXPECT_EQ(m.join().local_world_size(), 4u);
  EXPECT_EQ(m.join().timeout_ms(), 60000u);

  EXPECT_TRUE(parsed(wire::LeaveRequest{}).has_leave());

  m = parsed(wire::AbortRequest{"rank 2 died", true, -1});
  ASSERT_TRUE(m.has_abort());
  EXPECT_EQ(m.abort().reason(), "rank 2 died");
  EXPECT_TRUE(m.abort().failure());
  EXPECT_EQ(m.abort().culprit(), -1);  // int32: a sign-extended varint, not zig-zag

  m = parsed(wire::PathReport{"host-channels", "every rank on this node"});
  ASSERT_TRUE(m.has_path());
  EXPECT_EQ(m.path().path(), "host-channels");
  EXPECT_EQ(m.path().why(), "every rank on this node");
  EXPECT_EQ(m.path().gpu_memory_bytes(), 0u);

  m = parsed(wire::PathReport{"hierarchical", "2 nodes x 4 GPUs", 311427072ull, 33556080ull});
  EXPECT_EQ(m.path().gpu_memory_bytes(), 311427072ull);
  EXPECT_EQ(m.path().pinned_host_bytes(), 33556080ull);

  m = parsed(wire::TraceDumpRequest{std::string(1000, 'x')});
  ASSERT_TRUE(m.has_trace_dump());
  EXPECT_EQ(m.trace_dump().reason(), std::string(1000, 'x'));

  wire::RegroupRequest r;
  r.job_id = "elastic";
  r.token = "t";
  r.from_generation = (1ull << 40) + 3;
  r.old_world_size = 6;
  r.old_rank = -1;
  r.failed = {4, 0, 2147483647};
  r.newcomer = true;
  r.newcomers = 2;
  r.wait_ms = 1500;
  m = parsed(r);
  ASSERT_TRUE(m.has_regroup());
  EXPECT_EQ(m.regroup().node_id(), "");
  EXPECT_EQ(m.regroup().job_id(), "elastic");
  EXPECT_EQ(m.regroup().from_generation(), (1ull << 40) + 3);
  EXPECT_EQ(m.regroup().old_world_size(), 6u);
  EXPECT_EQ(m.regroup().old_rank(), -1);
  ASSERT_EQ(m.regroup().failed_size(), 3);
  EXPECT_EQ(m.regroup().failed(0), 4);
  EXPECT_EQ(m.regroup().failed(1), 0);
  EXPECT_EQ(m.regroup().failed(2), 2147483647);
  EXPECT_TRUE(m.regroup().newcomer());
  EXPECT_EQ(m.regroup().newcomers(), 2u);
  EXPECT_EQ(m.regroup().wait_ms(), 1500u);
}

v1::DaemonMessage full_join() {
  v1::DaemonMessage m;
  auto* j = m.mutable_join();
  j->set_generation(9);
  for (uint32_t r : {2u, 0u, 1u}) j->add_ring(r);
  for (const char* h : {"node-a", "node-b", "?"}) j->add_rank_hosts(h);
  auto* s = j->mutable_setup();
  s->set_shm_bytes(1ull << 33);
  s->set_slots(8);
  s->set_slot_bytes(1 << 20);
  s->set_num_channels(12);
  s->set_rings(2);
  s->set_recorders(3);
  s->set_recorder_entries(2000);
  s->set_recorder_index(1);
  for (uint32_t i = 0; i < 3; ++i) {
    auto* c = s->add_channels();
    c->set_tag(100 + i);
    c->set_peer(i);
    c->set_send(i % 2 == 0);
    c->set_index(i * 4);
    c->set_remote(i == 2);
    c->set_socket(i == 1 ? 1 : 0);
  }
  auto* v = j->mutable_verbs();
  v->set_device("mlx5_0");
  v->set_port(1);
  v->set_gid_index(-1);
  v->set_api("libibverbs.so.1");
  for (const char* d : {"mlx5_0", "", "mlx5_2"}) v->add_rail_devices(d);  // GPU 1: the daemon's device
  for (uint32_t n : {0u, 0u, 1u}) j->add_rank_node(n);
  j->set_data_host("10.1.2.3");
  // What the library skips: the job's GPU shapes.
  j->add_node_shape(0);
  j->add_node_shape(0);
  j->add_shapes()->set_source("nvml");
  return m;
}

TEST(DaemonWire, JoinReplyReadByTheLibrary) {
  auto reply = read(full_join());
  ASSERT_TRUE(reply.ok()) << reply.status().to_string();
  auto* j = std::get_if<wire::JoinResponse>(&reply.value());
  ASSERT_NE(j, nullptr);
  EXPECT_EQ(j->generation, 9u);
  EXPECT_EQ(j->ring, (std::vector<uint32_t>{2, 0, 1}));
  EXPECT_EQ(j->rank_hosts, (std::vector<std::string>{"node-a", "node-b", "?"}));
  EXPECT_EQ(j->setup.shm_bytes, 1ull << 33);
  EXPECT_EQ(j->setup.slots, 8u);
  EXPECT_EQ(j->setup.slot_bytes, 1u << 20);
  EXPECT_EQ(j->setup.num_channels, 12u);
  EXPECT_EQ(j->setup.rings, 2u);
  EXPECT_EQ(j->setup.recorders, 3u);
  EXPECT_EQ(j->setup.recorder_entries, 2000u);
  EXPECT_EQ(j->setup.recorder_index, 1u);
  ASSERT_EQ(j->setup.channels.size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    const wire::ChannelRef& c = j->setup.channels[i];
    EXPECT_EQ(c.tag, 100 + i);
    EXPECT_EQ(c.peer, i);
    EXPECT_EQ(c.send, i % 2 == 0);
    EXPECT_EQ(c.index, i * 4);
    EXPECT_EQ(c.remote, i == 2);
    EXPECT_EQ(c.socket, i == 1 ? 1u : 0u);
  }
  ASSERT_TRUE(j->verbs.has_value());
  EXPECT_EQ(j->verbs->device, "mlx5_0");
  EXPECT_EQ(j->verbs->port, 1u);
  EXPECT_EQ(j->verbs->gid_index, -1);
  EXPECT_EQ(j->verbs->api, "libibverbs.so.1");
  EXPECT_EQ(j->verbs->rail_devices, (std::vector<std::string>{"mlx5_0", "", "mlx5_2"}));
  EXPECT_EQ(j->rank_node, (std::vector<uint32_t>{0, 0, 1}));
  EXPECT_EQ(j->data_host, "10.1.2.3");

  // Without verbs (a TCP node), and the setup alone as tests hand it to build_links.
  v1::DaemonMessage tcp = full_join();
  tcp.mutable_join()->clear_verbs();
  auto plain = read(tcp);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(std::get<wire::JoinResponse>(plain.value()).verbs.has_value());
  // A daemon that lists no rails (TCP-only GPUs, or an older daemon): an empty list.
  v1::DaemonMessage no_rails = full_join();
  no_rails.mutable_join()->mutable_verbs()->clear_rail_devices();
  auto without = read(no_rails);
  ASSERT_TRUE(without.ok());
  ASSERT_TRUE(std::get<wire::JoinResponse>(without.value()).verbs.has_value());
  EXPECT_TRUE(std::get<wire::JoinResponse>(without.value()).verbs->rail_devices.empty());
  auto setup = wire::decode_channel_setup(full_join().join().setup().SerializeAsString());
  ASSERT_TRUE(setup.ok());
  EXPECT_EQ(setup->channels.size(), 3u);
  EXPECT_EQ(setup->recorder_entries, 2000u);
}

TEST(DaemonWire, OtherRepliesReadByTheLibrary) {
  v1::DaemonMessage m;
  m.mutable_attach()->set_node_name("n0");
  m.mutable_attach()->set_hostname("host0");
  m.mutable_attach()->set_protocol_version(1);
  auto a = read(m);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(std::get<wire::AttachResponse>(a.value()).node_name, "n0");
  EXPECT_EQ(std::get<wire::AttachResponse>(a.value()).hostname, "host0");
  EXPECT_EQ(std::get<wire::AttachResponse>(a.value()).protocol_version, 1u);

  m.Clear();
  m.mutable_error()->set_code(uint32_t(Code::kPermissionDenied));
  m.mutable_error()->set_message("wrong token");
  auto e = read(m);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(std::get<wire::ErrorResponse>(e.value()).code, uint32_t(Code::kPermissionDenied));
  EXPECT_EQ(std::get<wire::ErrorResponse>(e.value()).message, "wrong token");

  m.Clear();
  m.mutable_leave();
  auto l = read(m);
  ASSERT_TRUE(l.ok());
  EXPECT_TRUE(std::holds_alternative<wire::LeaveResponse>(l.value()));

  m.Clear();
  auto* g = m.mutable_regroup();
  g->set_generation(4);
  g->set_world_size(3);
  g->set_rank(2);
  g->set_local_rank(1);
  g->set_local_world_size(2);
  for (int r : {0, 2, -1}) g->add_old_ranks(r);
  auto rg = read(m);
  ASSERT_TRUE(rg.ok());
  const auto& got = std::get<wire::RegroupResponse>(rg.value());
  EXPECT_EQ(got.generation, 4u);
  EXPECT_EQ(got.world_size, 3u);
  EXPECT_EQ(got.rank, 2u);
  EXPECT_EQ(got.local_rank, 1u);
  EXPECT_EQ(got.local_world_size, 2u);
  EXPECT_EQ(got.old_ranks, (std::vector<int32_t>{0, 2, -1}));
}

void expect_refused(const std::string& bytes, const std::string& why) {
  auto r = wire::decode(bytes);
  ASSERT_FALSE(r.ok()) << why;
  EXPECT_EQ(r.status().code(), Code::kInternal);
  EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
}

TEST(DaemonWire, RepliesBeyondTheBoundsAreRefused) {
  v1::DaemonMessage m = full_join();
  m.mutable_join()->set_rank_hosts(1, std::string(wire::kMaxNameBytes + 1, 'h'));
  expect_refused(m.SerializeAsString(), "join.rank_hosts has 1025 bytes, above the limit of 1024");

  m = full_join();
  m.mutable_join()->set_data_host(std::string(wire::kMaxNameBytes + 1, 'd'));
  expect_refused(m.SerializeAsString(), "join.data_host has 1025 bytes, above the limit of 1024");

  m = full_join();
  m.mutable_join()->mutable_verbs()->set_api(std::string(wire::kMaxNameBytes + 1, 'a'));
  expect_refused(m.SerializeAsString(), "join.verbs.api has 1025 bytes");

  // Rail devices: names of at most 64 bytes, at most 64 of them (one per GPU of the node).
  m = full_join();
  m.mutable_join()->mutable_verbs()->add_rail_devices(std::string(topology::kMaxRailDeviceName, 'r'));
  ASSERT_TRUE(wire::decode(m.SerializeAsString()).ok());
  m.mutable_join()->mutable_verbs()->set_rail_devices(3, std::string(topology::kMaxRailDeviceName + 1, 'r'));
  expect_refused(m.SerializeAsString(), "join.verbs.rail_devices has 65 bytes, above the limit of 64");
  m = full_join();
  auto* rails = m.mutable_join()->mutable_verbs()->mutable_rail_devices();
  while (size_t(rails->size()) < topology::kMaxRailDevices) rails->Add("mlx5_9");
  ASSERT_TRUE(wire::decode(m.SerializeAsString()).ok());
  rails->Add("");
  expect_refused(m.SerializeAsString(), "join.verbs.rail_devices has 65 entries, above the limit of 64");

  m.Clear();
  m.mutable_error()->set_message(std::string(wire::kMaxErrorBytes + 1, 'e'));
  expect_refused(m.SerializeAsString(), "error.message has 65537 bytes");

  m.Clear();
  auto* ring = m.mutable_join()->mutable_ring();
  ring->Reserve(int(kMaxWorldSize) + 1);
  for (uint32_t i = 0; i <= kMaxWorldSize; ++i) ring->Add(i);
  expect_refused(m.SerializeAsString(), "join.ring has 1048577 entries, above the limit of 1048576");

  m.Clear();
  auto* hosts = m.mutable_join()->mutable_rank_hosts();
  for (uint32_t i = 0; i <= kMaxWorldSize; ++i) hosts->Add();
  expect_refused(m.SerializeAsString(), "join.rank_hosts has 1048577 entries");

  m.Clear();
  auto* old_ranks = m.mutable_regroup()->mutable_old_ranks();
  for (uint32_t i = 0; i <= kMaxWorldSize; ++i) old_ranks->Add(-1);
  expect_refused(m.SerializeAsString(), "regroup.old_ranks has 1048577 entries");
}

TEST(DaemonWire, MalformedRepliesAreRefused) {
  expect_refused("", "0 bodies");
  // Two bodies: protobuf would keep the last; the library takes neither.
  v1::DaemonMessage attach, leave;
  attach.mutable_attach()->set_node_name("n0");
  leave.mutable_leave();
  expect_refused(attach.SerializeAsString() + leave.SerializeAsString(), "2 bodies");
  // Cut short inside the join's setup.
  const std::string join = full_join().SerializeAsString();
  for (size_t cut : {size_t(1), size_t(5), join.size() / 2, join.size() - 1}) {
    EXPECT_FALSE(wire::decode(join.substr(0, cut)).ok()) << cut;
  }
  // A length prefix far beyond the bytes there are.
  expect_refused(std::string("\x12\xff\xff\xff\x0f", 5), "malformed reply from gradsyncd");
}

}  // namespace
}  // namespace gradsync
