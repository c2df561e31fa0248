#!/bin/sh
# PID 1 of the soft-RoCE test guest (baked into the image as /sbin/moe-guest-init;
# the busybox initramfs switch_roots here). It runs exactly one job and powers off:
#   /mnt/host  the repo checkout (9p, read-only: the guest must never modify it)
#   /mnt/job   a per-job host temp dir (9p, rw): cmd (script to run), out/ (results),
#              rc (written here: the command's exit status)
# Console protocol read by tests/rxe/vm.py (the serial console is the only channel
# that streams live): "moe-rxe: ..." progress lines, then the BEGIN marker, then the
# command's own output, then the sentinel "EXIT=<rc>". Anything that goes wrong
# before the command starts ends with EXIT=125 so the host never waits for a timeout.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 TERM=dumb

log() { echo "moe-rxe: $* (uptime $(cut -d' ' -f1 /proc/uptime)s)"; }

finish() {
    rc=$1
    [ -d /mnt/job ] && echo "$rc" > /mnt/job/rc
    sync
    # printf's leading \n: the command's last line may lack a newline; the host
    # drops that one blank line again.
    printf '\nEXIT=%s\n' "$rc"
    # sysrq "o" is an immediate power-off: no init system to stop, and 9p writes
    # are already on the host (the job mount is uncached).
    echo o > /proc/sysrq-trigger
    sleep 60
}

fail() { log "FATAL: $*"; dmesg 2>/dev/null | tail -n 20; finish 125; }

# The initramfs moved /dev /proc /sys here; mount whatever is still missing.
[ -e /proc/self ] || mount -t proc proc /proc
[ -d /sys/class ] || mount -t sysfs sysfs /sys
[ -c /dev/null ] || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
# /dev/shm: Python multiprocessing and the shm transport need it.
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs tmpfs /run
hostname rxe-guest
log "init started"

# crc32_generic first: rdma_rxe asks the crypto API for "crc32" at link time and
# modprobe's dependency data does not list it (ENOENT from `rdma link add` otherwise).
modprobe -a crc32_generic 9pnet_virtio 9p ib_uverbs rdma_ucm rdma_rxe dummy veth \
    || fail "modprobe failed"

# msize=512000: large 9p messages, far fewer round trips through the slow TCG guest.
# cache=loose on the checkout is safe because it is read-only and the host does not
# change it during a job; it makes Python imports from 9p much cheaper.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro host /mnt/host \
    || fail "cannot mount the checkout (9p tag host)"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 job /mnt/job \
    || fail "cannot mount the job dir (9p tag job)"
[ -f /mnt/job/cmd ] || fail "no /mnt/job/cmd"
mkdir -p /mnt/job/out

# No NIC needed: rxe runs over a dummy interface; two QPs in this guest talk through it.
ip link set lo up
ip link add eth0 type dummy && ip link set eth0 up \
    && ip addr add 10.0.2.15/24 dev eth0 || fail "cannot set up dummy eth0"
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0 failed"

# The IPv4-mapped GID (::ffff:10.0.2.15) appears asynchronously after the address;
# until it does, RoCE v2 address handles for 10.0.2.15 cannot be built.
gids=/sys/class/infiniband/rxe0/ports/1
gid_index=
i=0
while [ $i -lt 200 ]; do
    for f in $(grep -l 'ffff:0a00:020f$' $gids/gids/* 2>/dev/null); do
        idx=${f##*/}
        if [ "$(cat $gids/gid_attrs/types/$idx 2>/dev/null)" = "RoCE v2" ]; then
            gid_index=$idx
            break 2
        fi
    done
    sleep 0.1
    i=$((i + 1))
done
[ -n "$gid_index" ] || fail "rxe0 has no RoCE v2 IPv4 GID after 20 s"
log "rxe ready: rxe0 port 1 RoCE v2 GID index $gid_index"

# Keep kernel chatter off the console: from here on it carries the command's output.
dmesg -n 1

export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/mnt/host
export MOE_RXE_GUEST=1 MOE_JOB_OUT=/mnt/job/out
export MOE_RXE_DEVICE=rxe0 MOE_RXE_PORT=1 MOE_RXE_GID_INDEX=$gid_index
# Memory registration pins pages; root is exempt, but child tools may drop privileges.
ulimit -l unlimited 2>/dev/null
cd /mnt/host || fail "cannot cd /mnt/host"
echo "@@MOE-RXE-BEGIN@@"
sh /mnt/job/cmd < /dev/null
finish $?
