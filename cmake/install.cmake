# What `cmake --install` puts in place (docs/packaging.md):
#   bin/       gradsyncd, gradsync-coordinator, gradsyncrun, gradsyncctl, gradsync-bench, gradsync-limits
#   lib/       libgradsync.so.<major.minor> (+ the libgradsync.so link, component dev)
#   include/   gradsync/*.h, the public headers only (runtime/include/gradsync)
#   lib/cmake/gradsync/   the exported package: find_package(gradsync CONFIG) -> gradsync::gradsync
#   lib/pkgconfig/gradsync.pc
#   lib/systemd/system/*.service, etc/default/{gradsyncd,gradsync-coordinator}
# Components: `runtime` (the gradsync .deb) and `dev` (gradsync-dev).
include(CMakePackageConfigHelpers)

set(GRADSYNC_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/gradsync)

install(TARGETS gradsync_shared EXPORT gradsyncTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
install(DIRECTORY ${CMAKE_SOURCE_DIR}/runtime/include/gradsync
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev FILES_MATCHING PATTERN "*.h")
install(TARGETS gradsyncd gradsync-coordinator gradsyncrun gradsyncctl gradsync-bench gradsync-limits
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)

install(EXPORT gradsyncTargets NAMESPACE gradsync:: DESTINATION ${GRADSYNC_CMAKE_DIR} COMPONENT dev)
configure_package_config_file(${CMAKE_SOURCE_DIR}/cmake/gradsyncConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/cmake/gradsyncConfig.cmake
                              INSTALL_DESTINATION ${GRADSYNC_CMAKE_DIR})
# 0.x: a new minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/cmake/gradsyncConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/cmake/gradsyncConfig.cmake
              ${CMAKE_BINARY_DIR}/cmake/gradsyncConfigVersion.cmake
        DESTINATION ${GRADSYNC_CMAKE_DIR} COMPONENT dev)

# pkg-config: prefix-relative paths, so `pkg-config --define-prefix` works from a scratch prefix.
file(RELATIVE_PATH GRADSYNC_PC_LIBDIR_REL ${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig
     ${CMAKE_INSTALL_PREFIX})
configure_file(${CMAKE_SOURCE_DIR}/cmake/gradsync.pc.in ${CMAKE_BINARY_DIR}/gradsync.pc @ONLY)
install(FILES ${CMAKE_BINARY_DIR}/gradsync.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

# systemd units and their settings files (packaging/systemd; docs/packaging.md).
install(FILES ${CMAKE_SOURCE_DIR}/packaging/systemd/gradsyncd.service
              ${CMAKE_SOURCE_DIR}/packaging/systemd/gradsync-coordinator.service
        DESTINATION lib/systemd/system COMPONENT runtime)
# The units read /etc/default/*. For the prefix /usr (the packages) GNUInstallDirs' full
# sysconfdir is /etc while the relative one would put them in /usr/etc, where nothing reads
# them; other prefixes keep the relative path, so `cmake --install --prefix DIR` stays in DIR.
if(CMAKE_INSTALL_FULL_SYSCONFDIR STREQUAL "${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_SYSCONFDIR}")
  set(GRADSYNC_DEFAULTS_DIR ${CMAKE_INSTALL_SYSCONFDIR}/default)
else()
  set(GRADSYNC_DEFAULTS_DIR ${CMAKE_INSTALL_FULL_SYSCONFDIR}/default)
endif()
install(FILES ${CMAKE_SOURCE_DIR}/packaging/systemd/gradsyncd.default
        DESTINATION ${GRADSYNC_DEFAULTS_DIR} RENAME gradsyncd COMPONENT runtime)
install(FILES ${CMAKE_SOURCE_DIR}/packaging/systemd/gradsync-coordinator.default
        DESTINATION ${GRADSYNC_DEFAULTS_DIR} RENAME gradsync-coordinator COMPONENT runtime)
install(FILES ${CMAKE_SOURCE_DIR}/README.md ${CMAKE_SOURCE_DIR}/docs/packaging.md ${CMAKE_SOURCE_DIR}/docs/launchers.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
