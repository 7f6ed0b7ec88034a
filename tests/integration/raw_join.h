// Joins a job by talking the daemon protocol directly, skipping the library's own checks: for
// trainers that test what gradsyncd refuses or survives on its own (allreduce_worker rawjoin,
// hostile_trainer). The launcher's environment gives the request, as for a real trainer.
#pragma once

#include <chrono>
#include <cstdio>
#include <optional>

#include "client/daemon_client.h"
#include "gradsync/gradsync.h"

namespace gradsync::testing {

struct RawJoin {
  DaemonClient client;   // the connection: the rank is a member while it is open
  wire::JoinResponse join;
  Fd shm;                // the job's shared memory
};

// Prints "connect: STATUS" or "join: STATUS" to stderr on failure, "JOINED raw" on success.
inline std::optional<RawJoin> raw_join() {
  JoinOptions o = JoinOptions::from_env();
  auto deadline = deadline_after(o.join_timeout + std::chrono::seconds(5));
  auto client = DaemonClient::connect(default_daemon_socket(), deadline);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().to_string().c_str());
    return std::nullopt;
  }
  wire::JoinRequest req{o.job,
                        o.token,
                        static_cast<uint32_t>(o.rank),
                        static_cast<uint32_t>(o.world_size),
                        static_cast<uint32_t>(o.local_rank),
                        static_cast<uint32_t>(o.local_world_size),
                        static_cast<uint32_t>(o.join_timeout.count())};
  Fd shm;
  auto reply = client->call(req, deadline, &shm);
  if (!reply.ok()) {
    std::fprintf(stderr, "join: %s\n", reply.status().to_string().c_str());
    return std::nullopt;
  }
  auto* join = std::get_if<wire::JoinResponse>(&reply.value());
  if (join == nullptr) {
    std::fprintf(stderr, "join: gradsyncd answered with something else\n");
    return std::nullopt;
  }
  std::printf("JOINED raw\n");
  return RawJoin{std::move(client).value(), std::move(*join), std::move(shm)};
}

}  // namespace gradsync::testing
