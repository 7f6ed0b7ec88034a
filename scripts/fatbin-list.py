#!/usr/bin/env python3
"""Lists the GPU code embedded in a library or object: one line per fatbinary entry,
"ELF sm_XX" (a cubin) or "PTX compute_XX", as cuobjdump --list-elf / --list-ptx name them.

For machines whose CUDA has no cuobjdump (the dev VM's CUDA 13 comes from NVIDIA's pip wheels
without nvidia-cuda-cuobjdump). It reads only the fatbinary headers of the .nv_fatbin
section (extracted with binutils' objcopy): the container's magic and size, then per entry
its kind (1 PTX, 2 ELF), header size, payload size and target architecture.

    scripts/fatbin-list.py build/lib/libgradsync.so
"""
import struct
import subprocess
import sys
import tempfile

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "PTX", 2: "ELF"}


def entries(blob):
    off = 0
    while off + 16 <= len(blob):
        magic, _version, header, size = struct.unpack_from("<IHHQ", blob, off)
        if magic != FATBIN_MAGIC:
            break  # the section's padding after the last container
        pos, end = off + header, min(off + header + size, len(blob))
        while pos + 32 <= end:
            kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", blob, pos)
            arch = struct.unpack_from("<I", blob, pos + 28)[0]
            if entry_header < 32:
                raise SystemExit(f"fatbin entry at {pos}: header of {entry_header} bytes, not a fatbinary?")
            yield KINDS.get(kind, f"kind{kind}"), arch
            pos += entry_header + payload
        off = end


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with tempfile.NamedTemporaryFile() as out:
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", sys.argv[1], out.name], check=True)
        blob = open(out.name, "rb").read()
    if not blob:
        raise SystemExit(f"{sys.argv[1]}: no .nv_fatbin section (built without CUDA?)")
    counts = {}
    for kind, arch in entries(blob):
        name = f"{kind} {'compute' if kind == 'PTX' else 'sm'}_{arch}"
        counts[name] = counts.get(name, 0) + 1
    for name in sorted(counts, key=lambda n: (n.split()[0], int(n.rsplit("_", 1)[1]))):
        print(f"{name}: {counts[name]} image(s)")


if __name__ == "__main__":
    main()
