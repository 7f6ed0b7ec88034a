// Where the node's gradsyncd listens for trainers, the same rule for the daemon, the client
// library and the tools (docs/packaging.md, "Sockets").
//
// 1. $GRADSYNC_DAEMON when set.
// 2. /run/gradsync/gradsyncd.sock: the system daemon (gradsyncd.service, RuntimeDirectory=
//    gradsync, group gradsync).
// 3. $XDG_RUNTIME_DIR/gradsync/gradsyncd.sock: a user's own daemon (systemd --user, or started
//    by hand), when XDG_RUNTIME_DIR is set.
// 4. /tmp/gradsync-UID/gradsyncd.sock otherwise.
// A client takes the first of 2-4 whose socket exists; a daemon without --socket takes 2 when
// it may create it there (root, or /run/gradsync writable), else 3, else 4.
#pragma once

#include <string>
#include <vector>

#include "gradsync/status.h"

namespace gradsync {

std::vector<std::string> daemon_socket_candidates();  // 2, 3 (when XDG_RUNTIME_DIR is set), 4
std::string client_daemon_socket();                    // the client's choice (above)
std::string server_daemon_socket();                    // gradsyncd's default (above)

// Creates the socket's directory if missing (mode 0750) and refuses one that another user
// could use to replace the socket: not a directory, owned by neither this user nor root, or
// writable by others without the sticky bit.
Status prepare_socket_dir(const std::string& socket_path);

}  // namespace gradsync
