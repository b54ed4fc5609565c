#!/bin/bash
# One-time, idempotent host setup for the soft-RoCE (rdma_rxe) test harness. See README.md here.
#   - links Debian's pyverbs into the venv ($VENV, default <repo>/.venv)
#   - unpacks Debian's generic amd64 kernel into the cache dir ($KVBEAM_SOFTROCE_DIR, default
#     <repo>/.softroce) and extracts an uncompressed vmlinux from it, so qemu boots it via PVH
#   - builds the guest's busybox initramfs
# Each step checks whether it is already done, so a second run takes about a second.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${VENV:-$REPO/.venv}
DIR=${KVBEAM_SOFTROCE_DIR:-$REPO/.softroce}
APT_PKGS="qemu-system-x86 busybox-static cpio kmod iproute2 rdma-core ibverbs-utils ibverbs-providers libibverbs1 perftest python3-pyverbs"

die() { echo "softroce setup: ERROR: $*" >&2; exit 1; }
say() { echo "softroce setup: $*"; }

# --- 1. host tools (installed by .ci/run on fresh machines) ------------------------------------
missing=()
for tool in qemu-system-x86_64 busybox cpio depmod modprobe ip rdma ibv_devices ib_write_bw \
            apt-get apt-cache dpkg-deb gzip python3 sha256sum; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ -d /usr/lib/python3/dist-packages/pyverbs ] || missing+=("pyverbs (python3-pyverbs)")
[ ${#missing[@]} -eq 0 ] || die "missing: ${missing[*]}
  install with: apt-get install -y --no-install-recommends $APT_PKGS"
# The initramfs has no libc, so its busybox must be the static one (busybox-static, not busybox).
BUSYBOX=$(command -v busybox)
case $(ldd "$BUSYBOX" 2>&1 || true) in
  *"not a dynamic executable"*) ;;
  *) die "$BUSYBOX is dynamically linked; install busybox-static";;
esac

# --- 2. Debian's pyverbs (rdma-core 44) in the venv --------------------------------------------
# pip's pyverbs does not build/import against bookworm's libibverbs; Debian's CPython 3.11
# extension modules load fine in any CPython 3.11 venv.
[ -x "$VENV/bin/python" ] || die "no venv at $VENV (create it first, or set VENV=)"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "Debian's pyverbs is built for CPython 3.11; $VENV/bin/python is $("$VENV/bin/python" -V)"
if [ -e "$SITE/pyverbs" ] && [ ! -L "$SITE/pyverbs" ]; then
  die "$SITE/pyverbs is a real directory (pip install pyverbs?); remove it: Debian's is linked instead"
fi
ln -sfn /usr/lib/python3/dist-packages/pyverbs "$SITE/pyverbs"
"$VENV/bin/python" -c 'import pyverbs.device' || die "pyverbs does not import in $VENV"

# --- 3. guest kernel ---------------------------------------------------------------------------
mkdir -p "$DIR"
if [ -f "$DIR/kroot/KVER" ]; then
  KVER=$(cat "$DIR/kroot/KVER")
else
  # The generic flavour: linux-image-cloud-amd64 has no rdma_rxe.ko.
  KPKG=${KVBEAM_SOFTROCE_KPKG:-$(apt-cache depends linux-image-amd64 2>/dev/null \
        | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')}
  [ -n "$KPKG" ] || die "apt-cache knows no linux-image-amd64 (run apt-get update?)"
  KVER=${KPKG#linux-image-}
  say "downloading and unpacking $KPKG (about 100 MB, not installed)"
  rm -rf "$DIR/kroot.tmp" "$DIR/debs"
  mkdir -p "$DIR/kroot.tmp" "$DIR/debs"
  # apt warns that it downloads unsandboxed as root; harmless.
  (cd "$DIR/debs" && apt-get download -q "$KPKG" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
  deb=$(find "$DIR/debs" -name "${KPKG}_*.deb" | head -n1)
  [ -n "$deb" ] || die "apt-get download $KPKG failed (run apt-get update?)"
  dpkg-deb -x "$deb" "$DIR/kroot.tmp"
  [ -n "$(find "$DIR/kroot.tmp/lib/modules/$KVER" -name 'rdma_rxe.ko*' | head -n1)" ] \
    || die "$KPKG has no rdma_rxe module"
  depmod -b "$DIR/kroot.tmp" "$KVER"
  # Debian's bzImage is XZ-compressed; the ELF inside boots via PVH, skipping the in-guest
  # decompression (about 3 s under TCG).
  python3 - "$DIR/kroot.tmp/boot/vmlinuz-$KVER" "$DIR/kroot.tmp/boot/vmlinux-$KVER" <<'PY'
import lzma
import sys

data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
if start < 0:
    sys.exit("no XZ stream in " + sys.argv[1])
elf = lzma.LZMADecompressor().decompress(data[start:])
if elf[:4] != b"\x7fELF":
    sys.exit("XZ stream in " + sys.argv[1] + " is not an ELF vmlinux")
open(sys.argv[2], "wb").write(elf)
PY
  echo "$KVER" > "$DIR/kroot.tmp/KVER"
  rm -rf "$DIR/kroot" "$DIR/debs"
  mv "$DIR/kroot.tmp" "$DIR/kroot"   # last, so a half-done unpack is never taken as done
fi
[ -f "$DIR/kroot/boot/vmlinux-$KVER" ] || die "$DIR/kroot is incomplete; remove it and rerun"

# --- 4. initramfs: static busybox, the modules to mount 9p + overlayfs, and our /init ----------
# modprobe --show-depends lists the .ko files in load order for this kernel's config.
INIT_MODULES="virtio_pci 9pnet_virtio 9p overlay"
# Rebuilt when its inputs change (this script included): cheap, about a second.
stamp=$( { cat "$HERE/guest/initramfs-init" "${BASH_SOURCE[0]}"; sha256sum "$BUSYBOX"
           echo "$KVER $INIT_MODULES"; } | sha256sum | cut -d' ' -f1)
if [ ! -f "$DIR/initramfs.cpio.gz" ] || [ "$(cat "$DIR/initramfs.stamp" 2>/dev/null)" != "$stamp" ]; then
  say "building initramfs for $KVER"
  root=$(mktemp -d "$DIR/initramfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  mkdir -p "$root"/{bin,dev,proc,sys,lower,rw,newroot,modules}
  cp "$BUSYBOX" "$root/bin/busybox"
  # shellcheck disable=SC2086
  modprobe -d "$DIR/kroot" -S "$KVER" --show-depends -a $INIT_MODULES | awk '$1 == "insmod" {print $2}' \
    | while read -r ko; do
        name=$(basename "$ko")
        grep -qxF "$name" "$root/modules/order" 2>/dev/null && continue
        cp "$ko" "$root/modules/$name" && echo "$name" >> "$root/modules/order"
      done
  for m in $INIT_MODULES; do
    grep -qx "$m.ko" "$root/modules/order" || die "$m.ko missing from the initramfs (built into $KVER?)"
  done
  install -m 755 "$HERE/guest/initramfs-init" "$root/init"
  (cd "$root" && find . | cpio -o -H newc --quiet | gzip -1 > "$DIR/initramfs.cpio.gz.tmp")
  mv "$DIR/initramfs.cpio.gz.tmp" "$DIR/initramfs.cpio.gz"
  echo "$stamp" > "$DIR/initramfs.stamp"
fi

say "ready: kernel $KVER, cache $DIR, pyverbs linked into $VENV"
