// common/socket_path: the daemon socket's default for clients and the daemon, and the checks
// on its directory (another user must not be able to replace the socket).
#include "common/socket_path.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace gradsync {
namespace {

namespace fs = std::filesystem;

class SocketPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/socket_path_test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    saved_daemon_ = getenv("GRADSYNC_DAEMON") ? getenv("GRADSYNC_DAEMON") : "";
    saved_xdg_ = getenv("XDG_RUNTIME_DIR") ? getenv("XDG_RUNTIME_DIR") : "";
    unsetenv("GRADSYNC_DAEMON");
    setenv("XDG_RUNTIME_DIR", dir_.c_str(), 1);
  }
  void TearDown() override {
    fs::remove_all(dir_);
    restore("GRADSYNC_DAEMON", saved_daemon_);
    restore("XDG_RUNTIME_DIR", saved_xdg_);
  }
  static void restore(const char* name, const std::string& value) {
    if (value.empty()) unsetenv(name);
    else setenv(name, value.c_str(), 1);
  }
  fs::path dir_;
  std::string saved_daemon_, saved_xdg_;
};

TEST_F(SocketPathTest, CandidatesInOrder) {
  const auto c = daemon_socket_candidates();
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0], "/run/gradsync/gradsyncd.sock");
  EXPECT_EQ(c[1], (dir_ / "gradsync" / "gradsyncd.sock").string());
  EXPECT_EQ(c[2], "/tmp/gradsync-" + std::to_string(getuid()) + "/gradsyncd.sock");
  unsetenv("XDG_RUNTIME_DIR");
  EXPECT_EQ(daemon_socket_candidates().size(), 2u);
}

TEST_F(SocketPathTest, ClientTakesTheEnvironmentThenTheFirstThatExists) {
  setenv("GRADSYNC_DAEMON", "/somewhere/d.sock", 1);
  EXPECT_EQ(client_daemon_socket(), "/somewhere/d.sock");
  EXPECT_EQ(server_daemon_socket(), "/somewhere/d.sock");
  unsetenv("GRADSYNC_DAEMON");
  const auto c = daemon_socket_candidates();
  if (!fs::exists(c[0])) {
    EXPECT_EQ(client_daemon_socket(), c[0]) << "none exists: the system socket, for the error message";
    fs::create_directories(dir_ / "gradsync");
    std::ofstream(c[1]).put('x');
    EXPECT_EQ(client_daemon_socket(), c[1]);
  }
}

TEST_F(SocketPathTest, DirectoryIsCreatedPrivate) {
  const fs::path sock = dir_ / "new" / "gradsyncd.sock";
  ASSERT_TRUE(prepare_socket_dir(sock.string()).ok());
  struct stat st {};
  ASSERT_EQ(stat((dir_ / "new").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0027, 0u) << "neither group-writable nor open to others";
  // An existing private directory and a sticky shared one (/tmp) are fine.
  EXPECT_TRUE(prepare_socket_dir(sock.string()).ok());
  EXPECT_TRUE(prepare_socket_dir("/tmp/x.sock").ok());
}

TEST_F(SocketPathTest, RefusesDirectoriesOthersControl) {
  const fs::path open_dir = dir_ / "open";
  fs::create_directory(open_dir);
  chmod(open_dir.c_str(), 0777);
  Status s = prepare_socket_dir((open_dir / "d.sock").string());
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("mode 0777"), std::string::npos) << s.message();

  const fs::path link = dir_ / "link";
  fs::create_directory_symlink(dir_, link);
  s = prepare_socket_dir((link / "d.sock").string());
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("not a directory"), std::string::npos) << s.message();

  if (geteuid() == 0) {  // another owner: only root can make one
    const fs::path theirs = dir_ / "theirs";
    fs::create_directory(theirs);
    ASSERT_EQ(chown(theirs.c_str(), 12345, 12345), 0);
    s = prepare_socket_dir((theirs / "d.sock").string());
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
    EXPECT_NE(s.message().find("owner uid 12345"), std::string::npos) << s.message();
  }
}

}  // namespace
}  // namespace gradsync
