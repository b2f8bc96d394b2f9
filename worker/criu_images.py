"""Read just enough of CRIU's image files to tell which memory a snapshot holds.

An image file is a u32 common magic (IMG_COMMON_MAGIC), a u32 image magic, then entries,
each a u32 little-endian length followed by a protobuf message (CRIU's images/*.proto, proto2).
We decode the few messages we need by hand so no CRIU Python package (pycrit) is required:

- pstree.img: pstree_entry {pid=1, ppid=2, pgid=3, sid=4, threads=5}
- mm-<pid>.img: mm_entry {vmas=14: vma_entry {start=1, end=2, pgoff=3, shmid=4, prot=5,
  flags=6, status=7}}
- pagemap-shmem-<shmid>.img: like a pagemap, for a shared object, with byte offsets as vaddr
- files.img: file_entry {type=1, id=2, memfd=20: memfd_file_entry {inode_id=5}} and memfd.img:
  memfd_inode_entry {shmid=5, inode_id=7}: a memfd (also what MAP_SHARED anonymous memory is
  dumped as) maps as VMA shmid = file id -> inode -> the shmid of its pagemap-shmem image
- pagemap-<pid>.img: a pagemap_head {pages_id=1}, then pagemap_entry {vaddr=1, nr_pages=2,
  in_parent=3, flags=4, pages=5}: the private pages whose contents are in pages-<id>.img.
  CRIU 4.x writes the page count as the 64-bit `pages` (5) and leaves nr_pages 0.

`dumped_bytes_in(images_dir, ranges)` answers the question a snapshot must get right: how
many bytes of the given address ranges (the detached weights and KV cache) did CRIU store?
"""
from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

IMG_COMMON_MAGIC = 0x54564319
PSTREE_MAGIC = 0x50273030
MM_MAGIC = 0x57492820
PAGEMAP_MAGIC = 0x56084025
FILES_MAGIC = 0x56303138
MEMFD_INODE_MAGIC = 0x48453499
FILE_TYPE_MEMFD = 18
PAGE_SIZE = 4096
PE_PRESENT = 4


class ImageError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ImageError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def decode_fields(buf: bytes) -> dict[int, list[int | bytes]]:
    """A protobuf message's fields: number -> values (varints as int, length-delimited as bytes)."""
    fields: dict[int, list[int | bytes]] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ImageError(f"unsupported protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    if pos != len(buf):
        raise ImageError("truncated protobuf message")
    return fields


def read_entries(path: Path, magic: int) -> Iterator[bytes]:
    data = path.read_bytes()
    if len(data) < 8:
        raise ImageError(f"{path} is too short to be a CRIU image")
    common, got = struct.unpack_from("<II", data, 0)
    if common != IMG_COMMON_MAGIC or got != magic:
        raise ImageError(f"{path}: magic {common:#x}/{got:#x}, expected {IMG_COMMON_MAGIC:#x}/{magic:#x}")
    pos = 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError(f"{path}: truncated entry header at byte {pos}")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageError(f"{path}: truncated entry at byte {pos}")
        yield data[pos:pos + size]
        pos += size


def _one(fields: dict[int, list], number: int, default: int = 0) -> int:
    values = fields.get(number)
    return int(values[-1]) if values else default


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    prot: int
    flags: int
    status: int
    shmid: int             # the shared object (file, shmem, memfd) id; 0 for private anonymous memory
    pgoff: int = 0         # byte offset of `start` inside that object

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ImageError(f"VMA {self.start:#x}-{self.end:#x} is empty or inverted")


@dataclass(frozen=True)
class PageRun:
    """A run of pages whose contents the image holds (pagemap entry)."""
    vaddr: int
    nr_pages: int
    flags: int
    in_parent: bool

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE


@dataclass(frozen=True)
class TreeEntry:
    pid: int
    ppid: int
    sid: int
    threads: tuple[int, ...]


def process_tree(images_dir: Path) -> list[TreeEntry]:
    out = []
    for entry in read_entries(images_dir / "pstree.img", PSTREE_MAGIC):
        f = decode_fields(entry)
        out.append(TreeEntry(_one(f, 1), _one(f, 2), _one(f, 4), tuple(int(t) for t in f.get(5, []))))
    if not out:
        raise ImageError(f"{images_dir}/pstree.img lists no process")
    return out


def vmas(images_dir: Path, pid: int) -> list[Vma]:
    entries = list(read_entries(images_dir / f"mm-{pid}.img", MM_MAGIC))
    if len(entries) != 1:
        raise ImageError(f"mm-{pid}.img holds {len(entries)} entries, expected 1")
    out = []
    for raw in decode_fields(entries[0]).get(14, []):
        f = decode_fields(raw)  # type: ignore[arg-type]
        out.append(Vma(_one(f, 1), _one(f, 2), _one(f, 5), _one(f, 6), _one(f, 7), _one(f, 4), _one(f, 3)))
    return out


def page_runs(images_dir: Path, pid: int) -> list[PageRun]:
    entries = list(read_entries(images_dir / f"pagemap-{pid}.img", PAGEMAP_MAGIC))
    out = []
    for raw in entries[1:]:  # entries[0] is the pagemap_head
        f = decode_fields(raw)
        out.append(PageRun(_one(f, 1), _one(f, 5, _one(f, 2)), _one(f, 4), bool(_one(f, 3))))
    return out


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def shmem_runs(images_dir: Path, shmid: int) -> list[PageRun]:
    """Pages of a shared object (MAP_SHARED anonymous memory, a memfd) the image holds; their
    `vaddr` is the byte offset inside the object. Empty when the image holds none."""
    path = images_dir / f"pagemap-shmem-{shmid}.img"
    if not path.exists():
        return []
    out = []
    for raw in list(read_entries(path, PAGEMAP_MAGIC))[1:]:
        f = decode_fields(raw)
        out.append(PageRun(_one(f, 1), _one(f, 5, _one(f, 2)), _one(f, 4), bool(_one(f, 3))))
    return out


def _memfd_shmids(images_dir: Path) -> dict[int, int]:
    """file id -> shmid of its contents' pagemap, for the memfds in the image."""
    files, memfd = images_dir / "files.img", images_dir / "memfd.img"
    if not files.exists() or not memfd.exists():
        return {}
    inode_shmid = {}
    for raw in read_entries(memfd, MEMFD_INODE_MAGIC):
        f = decode_fields(raw)
        inode_shmid[_one(f, 7)] = _one(f, 5)
    out = {}
    for raw in read_entries(files, FILES_MAGIC):
        f = decode_fields(raw)
        if _one(f, 1) == FILE_TYPE_MEMFD and f.get(20):
            inode = _one(decode_fields(f[20][-1]), 5)  # type: ignore[arg-type]
            if inode in inode_shmid:
                out[_one(f, 2)] = inode_shmid[inode]
    return out


def dumped_bytes_in(images_dir: Path, ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes of the [start, end) `ranges` whose page contents any process of the image holds:
    its private pages (pagemap) and the pages of shared objects mapped there (pagemap-shmem)."""
    total = 0
    memfds = _memfd_shmids(images_dir)
    for proc in process_tree(images_dir):
        for run in page_runs(images_dir, proc.pid):
            total += sum(_overlap(run.vaddr, run.end, s, e) for s, e in ranges)
        for vma in vmas(images_dir, proc.pid):
            for s, e in ranges:
                lo, hi = max(s, vma.start), min(e, vma.end)
                if hi <= lo or not vma.shmid:
                    continue
                off0, off1 = vma.pgoff + lo - vma.start, vma.pgoff + hi - vma.start
                runs = shmem_runs(images_dir, memfds.get(vma.shmid, vma.shmid))
                total += sum(_overlap(r.vaddr, r.end, off0, off1) for r in runs)
    return total


def vmas_covering(images_dir: Path, pid: int, start: int, end: int) -> list[Vma]:
    """The VMAs of `pid` that intersect [start, end)."""
    return [v for v in vmas(images_dir, pid) if _overlap(v.start, v.end, start, end)]


def image_bytes(images_dir: Path) -> int:
    return sum(p.stat().st_size for p in images_dir.iterdir() if p.is_file())


__all__ = ["ImageError", "PageRun", "TreeEntry", "Vma", "decode_fields", "dumped_bytes_in", "image_bytes",
           "page_runs", "process_tree", "read_entries", "shmem_runs", "vmas", "vmas_covering"]
