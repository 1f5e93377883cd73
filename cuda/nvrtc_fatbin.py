"""Compile CUDA C++ files to fatbins with NVRTC, for `scripts/build-cuda.sh --cuda 12`.

PyPI carries no CUDA 12 `nvcc` driver or `cicc` (nvidia-cuda-nvcc-cu12 holds only ptxas and
libnvvm), but it carries NVRTC 12.x (nvidia-cuda-nvrtc-cu12): the same front end and code
generator, as a library. This script compiles each source once per target with it: machine code
(cubin) for every `--sass` capability, and PTX for the `--ptx` one; then packs them into one
fatbin with `fatbinary` (CUDA 13's: it only writes the container; uncompressed, since the newer
compression modes need newer drivers).

  python nvrtc_fatbin.py --nvrtc LIB --fatbinary BIN --sass 80,90 --ptx 90 \
      -I INCLUDE ... --out-dir DIR SRC.cu ...     # -> DIR/SRC.fatbin for each SRC
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor


def nvrtc_lib(path):
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def check(lib, status, what):
    if status != 0:
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def compile_one(lib, src_path, arch, options):
    """Compile `src_path` for `arch` ("sm_80": cubin, "compute_90": PTX); return the bytes."""
    with open(src_path, "rb") as f:
        text = f.read()
    prog = ctypes.c_void_p()
    name = os.path.basename(src_path).encode()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), text, name, 0, None, None), f"{src_path}: nvrtcCreateProgram")
    # NVRTC does not look next to the source for quoted includes, as nvcc does
    opts = [f"--gpu-architecture={arch}", f"-I{os.path.dirname(os.path.abspath(src_path))}"] + options
    argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    status = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status != 0:
        sys.stderr.write(log.value.decode(errors="replace"))
        check(lib, status, f"{src_path} for {arch}")
    cubin = arch.startswith("sm_")
    get_size = lib.nvrtcGetCUBINSize if cubin else lib.nvrtcGetPTXSize
    get = lib.nvrtcGetCUBIN if cubin else lib.nvrtcGetPTX
    check(lib, get_size(prog, ctypes.byref(size)), f"{src_path}: size")
    buf = ctypes.create_string_buffer(size.value)
    check(lib, get(prog, buf), f"{src_path}: output")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    data = buf.raw
    # PTX comes back NUL-terminated; fatbinary wants the text alone
    return data.rstrip(b"\0") if not cubin else data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", required=True, help="libnvrtc.so.12")
    ap.add_argument("--fatbinary", required=True, help="the fatbinary tool")
    ap.add_argument("--sass", default="", help="capabilities for machine code, e.g. 80,90 or 90a")
    ap.add_argument("--ptx", default="", help="capability for PTX, e.g. 90")
    ap.add_argument("-I", dest="includes", action="append", default=[])
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("sources", nargs="+")
    a = ap.parse_args()
    lib = nvrtc_lib(a.nvrtc)
    # nvcc includes cuda_runtime.h, and with it math.h, before every source; NVRTC does not
    options = ["-std=c++17", "-default-device", "--pre-include=math.h"]
    options += [f"-I{i}" for i in a.includes] + [f"-D{d}" for d in a.defines]
    sass = [c for c in a.sass.split(",") if c]
    ptx = [c for c in a.ptx.split(",") if c]
    jobs = [(src, f"sm_{c}") for src in a.sources for c in sass] + [(src, f"compute_{c}") for src in a.sources for c in ptx]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(lambda j: compile_one(lib, j[0], j[1], options), jobs))
    images = {}
    for (src, arch), data in zip(jobs, results):
        images.setdefault(src, []).append((arch, data))
    os.makedirs(a.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for src, parts in images.items():
            stem = os.path.splitext(os.path.basename(src))[0]
            args = [a.fatbinary, "-64", f"--create={os.path.join(a.out_dir, stem + '.fatbin.tmp')}", "--compress=false"]
            for arch, data in parts:
                kind = "elf" if arch.startswith("sm_") else "ptx"
                cap = arch.split("_", 1)[1]
                part = os.path.join(tmp, f"{stem}.{arch}.{kind}")
                with open(part, "wb") as f:
                    f.write(data)
                args.append(f"--image3=kind={kind},sm={cap},file={part}")
            subprocess.run(args, check=True)
            os.replace(os.path.join(a.out_dir, stem + ".fatbin.tmp"), os.path.join(a.out_dir, stem + ".fatbin"))


if __name__ == "__main__":
    main()
