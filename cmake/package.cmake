# CPack: two Debian packages (scripts/package.sh; docs/packaging.md).
#   gradsync      component runtime: daemon, coordinator, tools, libgradsync.so.*, systemd units
#   gradsync-dev  component dev: headers, libgradsync.so link, CMake package, gradsync.pc
# Dependencies come from dpkg-shlibdeps on the built binaries (Debian 12 library packages).
# A CUDA build links the shared CUDA runtime, which Debian 12 does not package in version 13:
# that build adds NVIDIA's cuda-cudart-X-Y (NVIDIA's apt repository) by name.
set(CPACK_PACKAGE_NAME gradsync)
set(CPACK_PACKAGE_VENDOR "gradsync")
set(CPACK_PACKAGE_CONTACT "gradsync maintainers <gradsync@localhost>")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "distributed gradient synchronization for C++ training loops")
set(CPACK_GENERATOR DEB)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_STRIP_FILES ON)  # RelWithDebInfo builds: the packages carry no debug info
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME gradsync)
set(CPACK_DEBIAN_DEV_PACKAGE_NAME gradsync-dev)
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION
    "gradsync daemon, coordinator, launcher and client library\n gradsyncd (one per node), gradsync-coordinator, gradsyncrun, gradsyncctl,\n gradsync-bench and libgradsync.so, with systemd units.")
set(CPACK_DEBIAN_DEV_DESCRIPTION
    "gradsync development files\n Public headers, the CMake package (find_package(gradsync)) and gradsync.pc.")
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS "gradsync (= ${PROJECT_VERSION})")
# conffiles: dpkg keeps an administrator's edits of /etc/default/* across upgrades. triggers:
# ldconfig after install for libgradsync.so.0.1 (CPack adds it only to the postrm it writes).
set(CPACK_DEBIAN_RUNTIME_PACKAGE_CONTROL_EXTRA ${CMAKE_SOURCE_DIR}/packaging/debian/postinst
    ${CMAKE_SOURCE_DIR}/packaging/debian/prerm ${CMAKE_SOURCE_DIR}/packaging/debian/conffiles
    ${CMAKE_SOURCE_DIR}/packaging/debian/triggers)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)  # CPack runs dpkg-shlibdeps --ignore-missing-info
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "adduser")  # postinst; shlibdeps adds the libraries
if(GRADSYNC_HAVE_CUDA)
  # libcudart.so.13 is in no Debian 12 package, so shlibdeps names nothing for it: NVIDIA's.
  find_package(CUDAToolkit REQUIRED)
  string(REPLACE "." ";" cuda_version "${CUDAToolkit_VERSION}")
  list(GET cuda_version 0 cuda_major)
  list(GET cuda_version 1 cuda_minor)
  string(APPEND CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS ", cuda-cudart-${cuda_major}-${cuda_minor}")
endif()
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SUGGESTS "systemd")
include(CPack)
