"""Soft-RoCE test harness: boot a qemu (TCG) Debian guest with an rxe device.

    python -m tests.rxe.vm build
    python -m tests.rxe.vm run [--timeout S] [--smp N] [--mem MB] [--out DIR] -- CMD ARGS...
    python -m tests.rxe.vm test [--timeout S] [--smp N] [--mem MB] [--out DIR] [--] [PYTEST ARGS...]

Stdlib only (Python 3.11). See tests/rxe/README.md for how it works and the
measured timings; the recipe is /work/shared/docs/soft-roce-in-qemu.md.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import lzma
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.summary import count_prefix

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
GUEST_INIT = HERE / "guest-init.sh"
SUITE = "bookworm"

# ---------------------------------------------------------------- build inputs
# Everything between BUILD-BEGIN and BUILD-END is hashed into the cache key.
# BUILD-BEGIN
BUILD_FORMAT = 1
HOST_TOOLS = {  # binary -> Debian package providing it
    "qemu-system-x86_64": "qemu-system-x86",
    "debootstrap": "debootstrap",
    "depmod": "kmod",
    "cpio": "cpio",
    "xz": "xz-utils",
    "mkfs.ext4": "e2fsprogs",
    "dpkg-deb": "dpkg",
}
BUSYBOX = "/bin/busybox"  # from busybox-static
GUEST_PACKAGES = [
    "rdma-core", "ibverbs-providers", "python3-pyverbs", "rdmacm-utils",
    "ibverbs-utils", "perftest", "iproute2", "kmod", "python3-numpy",
    "python3-msgpack", "python3-pytest", "procps", "python3-threadpoolctl",
    "python3-prometheus-client",
    "python3-pytest-timeout",  # setup.cfg sets `timeout = 300` for pytest
]
# Modules the guest loads (plus their dependency closure). crc32_generic: rdma_rxe
# requests the "crc32" crypto algorithm at link time and modprobe does not list it.
# bridge and sch_netem: the two-host link (tests/rxe/hosts.py) joins the hosts' veths on a
# bridge and misbehaves through tc netem.
GUEST_MODULES = [
    "crc32_generic", "virtio_pci", "virtio_net", "virtio_blk", "ext4",
    "9pnet_virtio", "9p", "ib_uverbs", "rdma_ucm", "rdma_rxe", "dummy", "veth",
    "bridge", "sch_netem",
]
# Loaded by the initramfs before switch_root (crc32c_generic: ext4 metadata csums).
INITRD_MODULES = ["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"]
IMAGE_SIZE = "1024M"

INITRD_INIT = r"""#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules.list); do insmod "$m" 2>/dev/null; done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
mount -t ext4 -o rw /dev/vda /newroot || { echo "initramfs: cannot mount /dev/vda"; echo "EXIT=125"; echo o > /proc/sysrq-trigger; sleep 60; }
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
exec switch_root /newroot /sbin/moe-guest-init
"""


def _sh(cmd, **kw):
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


def ensure_host_tools(need_build=True):
    tools = dict(HOST_TOOLS) if need_build else {"qemu-system-x86_64": "qemu-system-x86"}
    missing = sorted({pkg for b, pkg in tools.items() if not shutil.which(b)})
    if need_build and not os.path.exists(BUSYBOX):
        missing.append("busybox-static")
    if not missing:
        return
    log(f"installing host packages: {' '.join(missing)}")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _sh(sudo + ["apt-get", "update", "-q"], env=env)
    _sh(sudo + ["apt-get", "install", "-y", "-q"] + missing, env=env)


def debian_mirror():
    """The Debian mirror the host's apt uses for the main archive."""
    texts = []
    for p in [Path("/etc/apt/sources.list")] + sorted(Path("/etc/apt/sources.list.d").glob("*")):
        try:
            texts.append(p.read_text())
        except OSError:
            pass
    for text in texts:
        # one-line format: deb [opts] URI suite comps
        for line in text.splitlines():
            m = re.match(r"\s*deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", line)
            if m and m.group(2) == SUITE and "security" not in m.group(1):
                return m.group(1).rstrip("/")
        # deb822 format
        for stanza in re.split(r"\n\s*\n", text):
            fields = {}
            for line in stanza.splitlines():
                m = re.match(r"(\w[\w-]*):\s*(.*)", line)
                if m:
                    fields[m.group(1).lower()] = m.group(2)
            if SUITE in fields.get("suites", "").split() and "deb" in fields.get("types", "").split():
                for uri in fields.get("uris", "").split():
                    if "security" not in uri:
                        return uri.rstrip("/")
    raise SystemExit("rxe: no Debian bookworm mirror found in /etc/apt/sources.list*")


def module_closure(kroot, kver, mods):
    """Module files (relative to kroot) for mods and their deps, load order."""
    files, seen = [], set()
    for mod in mods:
        r = subprocess.run(["modprobe", "-d", str(kroot), "-S", kver, "--show-depends", mod],
                           capture_output=True, text=True)
        if r.returncode != 0:
            if "builtin" in r.stdout + r.stderr:
                continue
            raise SystemExit(f"rxe: module {mod} not found in {kver}: {r.stderr.strip()}")
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "insmod" and parts[1] not in seen:
                seen.add(parts[1])
                files.append(parts[1])
    return files


def extract_vmlinux(vmlinuz: Path, dest: Path):
    """Debian's bzImage is xz: decompressing it under TCG costs ~9 s a boot.
    Unpack the ELF vmlinux, which qemu boots directly via its PVH entry."""
    data = vmlinuz.read_bytes()
    off = data.find(b"\xfd7zXZ\x00")
    while off >= 0:
        try:
            d = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
            out = d.decompress(data[off:])
            if out[:4] == b"\x7fELF":
                dest.write_bytes(out)
                return
        except lzma.LZMAError:
            pass
        off = data.find(b"\xfd7zXZ\x00", off + 1)
    raise SystemExit(f"rxe: no xz-compressed ELF kernel in {vmlinuz}")


def build_key(kpkg, kver, packages):
    src = Path(__file__).read_text()
    build_src = src[src.index("# BUILD-BEGIN"):src.index("# BUILD-END")]
    h = hashlib.sha256()
    for part in (SUITE, kpkg, kver, " ".join(packages), GUEST_INIT.read_text(), build_src):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def do_build(cache: Path, workdir: Path, kpkg, packages, t0):
    mirror = debian_mirror()
    rootfs = workdir / "rootfs"
    log(f"debootstrap {SUITE} from {mirror} ({len(packages)} extra packages)", t0)
    _sh(["debootstrap", "--variant=minbase", "--include=" + ",".join(packages),
         SUITE, str(rootfs), mirror], stdout=subprocess.DEVNULL)
    log("debootstrap done", t0)

    kdir = workdir / "kdeb"
    kdir.mkdir()
    _sh(["apt-get", "download", "-q", kpkg], cwd=kdir, stdout=subprocess.DEVNULL)
    deb = next(kdir.glob("*.deb"))
    kroot = workdir / "kernel"
    _sh(["dpkg-deb", "-x", str(deb), str(kroot)])
    kver = kpkg[len("linux-image-"):]
    _sh(["depmod", "-b", str(kroot), kver])
    log(f"kernel {deb.name} unpacked", t0)

    extract_vmlinux(kroot / "boot" / f"vmlinuz-{kver}", workdir / "vmlinux")

    # Guest modules: only the closure, then depmod inside the rootfs.
    shutil.rmtree(rootfs / "lib/modules", ignore_errors=True)
    kmods = kroot / "lib/modules" / kver
    gmods = rootfs / "lib/modules" / kver
    gmods.mkdir(parents=True)
    for f in kmods.glob("modules.builtin*"):
        shutil.copy2(f, gmods / f.name)
    shutil.copy2(kmods / "modules.order", gmods / "modules.order")
    for f in module_closure(kroot, kver, GUEST_MODULES):
        p = Path(f)
        rel = p.relative_to(kmods)
        dst = gmods / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst)
    _sh(["depmod", "-b", str(rootfs), kver])

    # Guest init and mount points; drop caches that only cost image space.
    shutil.copy2(GUEST_INIT, rootfs / "sbin/moe-guest-init")
    os.chmod(rootfs / "sbin/moe-guest-init", 0o755)
    for d in ("mnt/host", "mnt/job"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
    (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
    for f in (rootfs / "var/lib/apt/lists").glob("*_Packages"):
        f.unlink()
    (rootfs / "etc/hostname").write_text("rxe-guest\n")
    versions = _sh(["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Package} ${Version}\\n"]
                   + packages + ["python3"], capture_output=True, text=True, check=False).stdout
    (workdir / "packages.txt").write_text(versions)

    _sh(["mkfs.ext4", "-q", "-F", "-L", "rxe-root", "-d", str(rootfs),
         str(workdir / "rootfs.ext4"), IMAGE_SIZE], stdout=subprocess.DEVNULL)
    log("rootfs.ext4 built", t0)

    # Tiny busybox initramfs: load virtio_blk + ext4, switch_root.
    ird = workdir / "initrd"
    for d in ("bin", "proc", "sys", "dev", "newroot", "mods"):
        (ird / d).mkdir(parents=True)
    shutil.copy2(BUSYBOX, ird / "bin/busybox")
    for a in ("sh", "mount", "insmod", "switch_root", "sleep", "cat", "mkdir", "echo"):
        os.symlink("busybox", ird / "bin" / a)
    order = []
    for i, f in enumerate(module_closure(kroot, kver, INITRD_MODULES)):
        name = f"{i:02d}-{Path(f).name}"
        shutil.copy2(f, ird / "mods" / name)
        order.append("/mods/" + name)
    (ird / "modules.list").write_text("\n".join(order) + "\n")
    (ird / "init").write_text(INITRD_INIT)
    os.chmod(ird / "init", 0o755)
    files = _sh("find . -print0 | sort -z", shell=True, cwd=ird, capture_output=True).stdout
    with open(workdir / "initrd.cpio", "wb") as fh:
        _sh(["cpio", "--null", "-o", "-H", "newc", "--quiet"], cwd=ird, input=files, stdout=fh)
    log("initramfs built", t0)

    shutil.rmtree(rootfs)
    shutil.rmtree(kroot)
    shutil.rmtree(kdir)
    shutil.rmtree(ird)
    (workdir / "meta.json").write_text(json.dumps(
        {"kernel": kpkg, "kver": kver, "packages": packages, "mirror": mirror,
         "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1))
# BUILD-END


def log(msg, t0=None):
    t = f"[{time.monotonic() - t0:6.1f}s] " if t0 is not None else ""
    print(f"rxe: {t}{msg}", file=sys.stderr, flush=True)


def key_inputs(packages):
    """(kernel package, its version, the packages bookworm has) from two apt-cache calls."""
    def depends():
        out = subprocess.run(["apt-cache", "depends", "linux-image-amd64"],
                             capture_output=True, text=True).stdout
        return re.search(r"Depends:\s*(linux-image-[0-9][\w.+-]*-amd64)", out)
    m = depends()
    if not m:
        _sh(([] if os.geteuid() == 0 else ["sudo"]) + ["apt-get", "update", "-q"])
        m = depends()
    if not m:
        raise SystemExit("rxe: cannot find the linux-image-6.1 package (apt-cache depends linux-image-amd64)")
    kpkg = m.group(1)
    out = subprocess.run(["apt-cache", "policy", kpkg] + list(packages),
                         capture_output=True, text=True).stdout
    cand = {}
    for block in re.split(r"\n(?=\S)", out):
        name = block.split(":", 1)[0].strip()
        v = re.search(r"Candidate:\s*(\S+)", block)
        if v and v.group(1) != "(none)":
            cand[name] = v.group(1)
    keep = []
    for p in packages:
        if p in cand:
            keep.append(p)
        else:
            log(f"note: {p} not available in {SUITE}; dropped from the image")
    return kpkg, cand.get(kpkg, "?"), keep


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_RXE_CACHE") or Path.home() / ".cache/moe-transport/rxe")


def build() -> Path:
    """Build or reuse the cached image; returns its directory."""
    t0 = time.monotonic()
    ensure_host_tools()
    kpkg, kver, packages = key_inputs(GUEST_PACKAGES)
    key = build_key(kpkg, kver, packages)
    cache = cache_dir()
    final = cache / f"image-{key}"
    if (final / "meta.json").exists():
        log(f"image cached: {final}", t0)
        return final
    if os.geteuid() != 0:
        raise SystemExit("rxe: building the image needs root (debootstrap, chroot)")
    cache.mkdir(parents=True, exist_ok=True)
    log(f"building image {key} ({kpkg} {kver}) in {cache}", t0)
    work = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
    try:
        do_build(cache, work, kpkg, packages, t0)
        try:
            os.rename(work, final)
        except OSError:
            if not (final / "meta.json").exists():  # a concurrent build won: reuse it
                raise
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log(f"image ready: {final}", t0)
    return final


# ---------------------------------------------------------------- running
BEGIN = "@@MOE-RXE-BEGIN@@"
SENTINEL = re.compile(r"^EXIT=(-?\d+)\s*$")


def _die_with_parent():
    # Runs in the qemu child before exec: the kernel SIGKILLs qemu when the harness dies,
    # even by SIGKILL (CI cancel, OOM killer), where no finally block can run.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def qemu_cmd(image: Path, jobdir: Path, smp: int = 2, mem: int = 2048):
    return [
        "qemu-system-x86_64", "-accel", "tcg,thread=multi,tb-size=256", "-cpu", "max",
        "-smp", str(smp), "-m", str(mem), "-nodefaults", "-display", "none", "-serial", "stdio",
        "-no-reboot", "-kernel", str(image / "vmlinux"), "-initrd", str(image / "initrd.cpio"),
        "-drive", f"file={image / 'rootfs.ext4'},format=raw,if=virtio,snapshot=on",
        "-device", "virtio-rng-pci",
        "-virtfs", f"local,path={REPO_ROOT},mount_tag=host,security_model=none,readonly=on,id=host",
        "-virtfs", f"local,path={jobdir},mount_tag=job,security_model=none,id=job",
        "-append", "console=ttyS0 rdinit=/init panic=-1 loglevel=4",
    ]


def run(cmd: list[str], timeout: float = 1200, out: str | None = None, quiet_boot=False,
        smp: int = 2, mem: int = 2048) -> int:
    image = build()
    t0 = time.monotonic()
    jobdir = Path(tempfile.mkdtemp(prefix="moe-rxe-job-"))
    proc = None
    try:
        (jobdir / "out").mkdir()
        (jobdir / "cmd").write_text("exec " + shlex.join(cmd) + "\n")
        os.chmod(jobdir, 0o777)
        log(f"booting guest (timeout {timeout:.0f}s): {shlex.join(cmd)}", t0)
        proc = subprocess.Popen(qemu_cmd(image, jobdir, smp, mem), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
        lines: queue.Queue = queue.Queue()

        def reader():
            for raw in proc.stdout:
                lines.put(raw.decode("utf-8", "replace").replace("\r", ""))
            lines.put(None)

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.monotonic() + timeout
        boot_log, started, rc_seen, pending_blank = [], False, None, False
        timed_out = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                break
            m = SENTINEL.match(line)
            if m:
                rc_seen = int(m.group(1))
                continue
            if rc_seen is not None:
                continue  # power-off chatter
            if not started:
                boot_log.append(line)
                if line.strip() == BEGIN:
                    started = True
                    log("guest ready, command output follows", t0)
                elif line.startswith("moe-rxe:"):
                    log(line.strip()[len("moe-rxe: "):], t0)
                continue
            # the guest prints "\nEXIT=": hold one blank line back
            if pending_blank:
                sys.stdout.write("\n")
                pending_blank = False
            if line == "\n":
                pending_blank = True
                continue
            sys.stdout.write(line)
            sys.stdout.flush()
        if proc.poll() is None:
            if rc_seen is not None and not timed_out:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        rcfile = jobdir / "rc"
        rc = None
        if rcfile.exists():
            try:
                rc = int(rcfile.read_text().strip())
            except ValueError:
                rc = None
        if rc is None:
            rc = rc_seen
        if out:
            dst = Path(out)
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copytree(jobdir / "out", dst, dirs_exist_ok=True)
        if timed_out:
            log(f"TIMEOUT after {timeout:.0f}s: qemu killed", t0)
            if not started:
                sys.stderr.write("".join(boot_log[-40:]))
            return 124
        if rc is None:
            log(f"guest died without an exit status (qemu rc {proc.returncode}); boot log tail:", t0)
            sys.stderr.write("".join(boot_log[-40:]))
            return 125
        if not started:
            log(f"guest failed before the command started (rc {rc}); boot log tail:", t0)
            sys.stderr.write("".join(boot_log[-40:]))
            return rc or 125
        log(f"command exited {rc}", t0)
        return rc
    finally:
        if proc is not None and proc.poll() is None:  # e.g. Ctrl-C: never leave qemu behind
            proc.kill()
            proc.wait()
        shutil.rmtree(jobdir, ignore_errors=True)


def host_rdma_available() -> bool:
    ib = Path("/sys/class/infiniband")
    try:
        devs = sorted(os.listdir(ib))
    except OSError:
        return False
    if not devs:
        return False
    r = subprocess.run([sys.executable, "-c",
                        "import sys\nfrom pyverbs.device import Context\n"
                        f"Context(name={devs[0]!r}).query_device()"],
                       capture_output=True, cwd=REPO_ROOT)
    return r.returncode == 0


def summarize(junit: Path) -> tuple[int, int, int]:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failed = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def test(pytest_args: list[str], out: str | None, timeout: float, smp: int = 2,
         mem: int = 2048) -> int:
    out_dir = Path(out or "build/rdma")
    out_dir.mkdir(parents=True, exist_ok=True)
    junit = out_dir / "junit.xml"
    if junit.exists():
        junit.unlink()
    if host_rdma_available():
        log("host has an RDMA device: running pytest on the host")
        try:
            rc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                                 f"--junitxml={junit}"] + pytest_args, cwd=REPO_ROOT,
                                env=dict(os.environ, MOE_JOB_OUT=str(out_dir.resolve())),
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log(f"TIMEOUT after {timeout:.0f}s: host pytest killed")
            rc = 124
    else:
        rc = run(["python3", "-m", "pytest", "-p", "no:cacheprovider",
                  "--junitxml=/mnt/job/out/junit.xml"] + pytest_args,
                 timeout=timeout, out=str(out_dir), smp=smp, mem=mem)
    if not junit.exists():
        print(f"RDMA suite: no junit.xml (pytest exit {rc})", flush=True)
        return rc or 1
    passed, failed, skipped = summarize(junit)
    two = count_prefix([str(junit)], "tests.rdma.two_hosts")
    if any(two.values()):  # run in this same session, on the guest's three-host link
        print(f"two-host suite: {two['passed']} passed, {two['failed']} failed, {two['skipped']} skipped")
    print(f"RDMA suite: {passed} passed, {failed} failed, {skipped} skipped", flush=True)
    if failed or skipped or passed == 0:
        if skipped:
            print("RDMA suite: FAILED (skipped tests mean the RDMA tests did not really run)")
        return rc or 1
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m tests.rxe.vm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("build", help="build or reuse the cached guest image")
    pr = sub.add_parser("run", help="run a command in the guest")
    pr.add_argument("--timeout", type=float, default=1200)
    pr.add_argument("--out", help="copy /mnt/job/out here")
    pr.add_argument("--smp", type=int, default=2)
    pr.add_argument("--mem", type=int, default=2048, help="guest RAM in MB")
    pt = sub.add_parser("test", help="run pytest in the guest (or on an RDMA host)")
    pt.add_argument("--timeout", type=float, default=1200)
    pt.add_argument("--out", default="build/rdma")
    pt.add_argument("--smp", type=int, default=2)
    pt.add_argument("--mem", type=int, default=2048, help="guest RAM in MB")
    # split at the first "--": everything after it belongs to the command
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    args, extra = ap.parse_known_args(argv)
    # SIGTERM (CI cancel, `timeout`) must unwind through the finally that kills qemu.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rest = extra + rest
    if args.verb == "build":
        build()
        return 0
    if args.verb == "run":
        if not rest:
            ap.error("run: no command given (run -- CMD ARGS)")
        return run(rest, timeout=args.timeout, out=args.out, smp=args.smp, mem=args.mem)
    return test(rest, args.out, args.timeout, smp=args.smp, mem=args.mem)


if __name__ == "__main__":
    sys.exit(main())
