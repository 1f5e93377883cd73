"""List the fatbins a binary embeds as plain data (the CUDA 12 build: candle's and ours, as byte
arrays, not in an .nv_fatbin section, so `cuobjdump FILE` finds none): each one is cut out by its
header (magic 0xBA55ED50, header size, payload size) and listed with cuobjdump.

  python list_fatbins.py CUOBJDUMP BINARY   # one line per fatbin: its ELF and PTX entries
"""
import os
import struct
import subprocess
import sys
import tempfile

MAGIC = struct.pack("<I", 0xBA55ED50)


def fatbins(data):
    i = data.find(MAGIC)
    while i >= 0:
        version, header, size = struct.unpack_from("<HHQ", data, i + 4)
        if version == 1 and header == 16 and 0 < size < len(data):
            yield i, data[i : i + header + size]
            i = data.find(MAGIC, i + header + size)
        else:
            i = data.find(MAGIC, i + 4)


def main():
    cuobjdump, binary = sys.argv[1], sys.argv[2]
    with open(binary, "rb") as f:
        data = f.read()
    total = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, (offset, fb) in enumerate(fatbins(data)):
            path = os.path.join(tmp, f"{n}.fatbin")
            with open(path, "wb") as f:
                f.write(fb)
            entries = []
            for flag, kind in (("--list-elf", "ELF"), ("--list-ptx", "PTX")):
                out = subprocess.run([cuobjdump, flag, path], capture_output=True, text=True).stdout
                for line in out.splitlines():
                    arch = line.rsplit(".", 2)[-2] if line.count(".") >= 2 else line
                    entries.append(f"{kind} {arch}")
                    total[f"{kind} {arch}"] = total.get(f"{kind} {arch}", 0) + 1
            # the first kernel name in the fatbin's ELF says which module it is
            names = subprocess.run([cuobjdump, "--dump-elf-symbols", path], capture_output=True, text=True).stdout
            kernel = next((w for line in names.splitlines() for w in line.split() if "STT_FUNC" in line and "STO_ENTRY" in line), "")
            first = next((line.split()[-1] for line in names.splitlines() if "STO_ENTRY" in line), "?")
            print(f"fatbin {n} at 0x{offset:x}, {len(fb)} bytes ({first}, ...): {', '.join(entries)}")
    print("total: " + ", ".join(f"{k} x{v}" for k, v in sorted(total.items())))


if __name__ == "__main__":
    main()
