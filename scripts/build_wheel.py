#!/usr/bin/env python3
"""Assemble the scfoundry wheel around a binary built already (no second compile):
scfoundry-<version>-py3-none-manylinux_2_<minor>_<arch>.whl, the manylinux tag from the newest
GLIBC_ symbol version the binary needs (2.28 for the release build, scripts/zig.sh) and the
architecture from its ELF header (x86_64 or aarch64).

The package is python/scfoundry plus the binary at scfoundry/bin/scfoundry (executable), a
`scfoundry` console script that runs it, the licences in the dist-info, and a RECORD with the
sha256 of every file. Standard library only.

    scripts/build_wheel.py --binary PATH [--out DIR]     # prints the wheel's path
"""
import argparse
import base64
import hashlib
import os
import re
import stat
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def version():
    text = open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8").read()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def glibc(binary):
    out = subprocess.run([os.path.join(ROOT, "scripts/check-glibc.sh"), binary], check=True, capture_output=True, text=True).stdout
    major, minor = out.strip().removeprefix("GLIBC_").split(".")[:2]
    return int(major), int(minor)


def machine(binary):
    """The platform tag's architecture, from the ELF header's e_machine."""
    with open(binary, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        sys.exit(f"build_wheel.py: {binary} is not an ELF binary")
    arch = {62: "x86_64", 183: "aarch64"}.get(int.from_bytes(head[18:20], "little"))
    if arch is None:
        sys.exit(f"build_wheel.py: {binary} is neither x86_64 nor aarch64")
    return arch


def digest(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"))
    a = ap.parse_args()
    ver = version()
    major, minor = glibc(a.binary)
    arch = machine(a.binary)
    tag = f"py3-none-manylinux_{major}_{minor}_{arch}"
    dist = f"scfoundry-{ver}.dist-info"
    summary = re.search(r'^description = "([^"]+)"', open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8").read(), re.M).group(1)
    metadata = "\n".join([
        "Metadata-Version: 2.4", "Name: scfoundry", f"Version: {ver}", f"Summary: {summary}",
        "License-Expression: MIT OR Apache-2.0", "License-File: LICENSE-MIT", "License-File: LICENSE-APACHE",
        "License-File: THIRD-PARTY-NOTICES", "Requires-Python: >=3.9", "Requires-Dist: anndata>=0.8",
        "Description-Content-Type: text/markdown", "",
        "The scfoundry binary (single-cell foundation models and baselines on AnnData files, CPU build)\n"
        "with `scfoundry.embed(adata, method=...)` around it; the command `scfoundry` is the binary.\n",
    ])
    wheel = f"Wheel-Version: 1.0\nGenerator: scfoundry scripts/build_wheel.py\nRoot-Is-Purelib: false\nTag: {tag}\n"
    entry = "[console_scripts]\nscfoundry = scfoundry.__main__:main\n"
    notices = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/third_party.py"), "--flavour", "cpu", "--triple", f"{arch}-unknown-linux-gnu", "/dev/stdout"],
                             check=True, capture_output=True, cwd=ROOT).stdout
    files = []  # (name in the wheel, bytes, executable)
    pkg = os.path.join(ROOT, "python/scfoundry")
    for f in sorted(os.listdir(pkg)):
        if f.endswith(".py"):
            files.append((f"scfoundry/{f}", open(os.path.join(pkg, f), "rb").read(), False))
    files.append(("scfoundry/bin/scfoundry", open(a.binary, "rb").read(), True))
    for f in ("LICENSE-MIT", "LICENSE-APACHE"):
        files.append((f"{dist}/licenses/{f}", open(os.path.join(ROOT, f), "rb").read(), False))
    files += [(f"{dist}/licenses/THIRD-PARTY-NOTICES", notices, False), (f"{dist}/METADATA", metadata.encode(), False),
              (f"{dist}/WHEEL", wheel.encode(), False), (f"{dist}/entry_points.txt", entry.encode(), False)]
    record = "".join(f"{n},{digest(d)},{len(d)}\n" for n, d, _ in files) + f"{dist}/RECORD,,\n"
    files.append((f"{dist}/RECORD", record.encode(), False))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"scfoundry-{ver}-{tag}.whl")
    with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, exe in files:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = ((0o755 if exe else 0o644) | stat.S_IFREG) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    os.replace(path + ".tmp", path)
    print(path)


if __name__ == "__main__":
    main()
