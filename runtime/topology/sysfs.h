// Small readers for sysfs and procfs files, shared by the topology code.
#pragma once

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace gradsync::topology::sysfs {

// The first line of a file without trailing whitespace; "" when it cannot be read.
inline std::string read_first_line(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  return line;
}

// Sorted entry names of a directory; empty when it does not exist (containers, CI).
inline std::vector<std::string> list_dir(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace gradsync::topology::sysfs
