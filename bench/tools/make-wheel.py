"""Writes a pure-python wheel of N small modules, offline (stdlib only).

    python3 make-wheel.py OUT_DIR N [NAME]

The wheel holds a package NAME with N modules (`__init__.py` files included) in
subpackages of 100, plus its .dist-info (METADATA, WHEEL, RECORD). Module sizes vary
from ~0.5 to ~6 KiB like a real library's; every module is valid python, so
`pip install` byte-compiles each one. Prints the wheel's path.
Used by grove-bench's filesystem scenario (FS-5) and bench/tools/fuse-requests.
"""
import base64
import hashlib
import os
import sys
import zipfile

out_dir, n = sys.argv[1], int(sys.argv[2])
name = sys.argv[3] if len(sys.argv) > 3 else "fs5bench"
version = "1.0"
per_pkg = 100


def module(i):
    lines = [f'"""Module {i} of the {name} benchmark package."""', "", "import os", ""]
    for k in range(1 + (i * 7) % 12):
        lines += [
            f"CONSTANT_{k} = {i * 31 + k}",
            "",
            f"def function_{k}(x, y={k}):",
            f'    """Return a value derived from x ({i}, {k})."""',
            f"    total = x + y * {k + 1}",
            "    for j in range(3):",
            "        total += j",
            "    return total",
            "",
            f"class Thing{k}:",
            "    def __init__(self, value):",
            "        self.value = value",
            "",
            "    def describe(self):",
            f'        return "thing {k}: %r" % (self.value,)',
            "",
        ]
    return ("\n".join(lines) + "\n").encode()


files = []
pkgs = (n + per_pkg - 1) // per_pkg
made = 0
for p in range(pkgs):
    count = min(per_pkg, n - made)
    base = f"{name}/sub{p:03d}"
    files.append((f"{base}/__init__.py", module(made)))
    for m in range(1, count):
        files.append((f"{base}/mod{m:03d}.py", module(made + m)))
    made += count
info = f"{name}-{version}.dist-info"
files.append((f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()))
files.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: grove-bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"))


def digest(data):
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={h}"


record = "".join(f"{p},{digest(d)},{len(d)}\n" for p, d in files) + f"{info}/RECORD,,\n"
files.append((f"{info}/RECORD", record.encode()))
os.makedirs(out_dir, exist_ok=True)
path = os.path.join(out_dir, f"{name}-{version}-py3-none-any.whl")
with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
    for p, d in files:
        zi = zipfile.ZipInfo(p, date_time=(2026, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(zi, d)
os.replace(path + ".tmp", path)
print(path)
