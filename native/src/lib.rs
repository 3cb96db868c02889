//! Capsule's per-block hot paths, compiled: BLAKE3 of 4 KiB blocks into manifest records, zstd
//! batches, verification of received blocks, and writing runs of blocks into a shadow.
//!
//! Every function here has a pure-Python reference in `hashcache/` that defines its output byte for
//! byte (`hashcache.blocks`, `hashcache.manifest`, `hashcache.hcp`, `hashcache.shadow`); the property
//! tests in `tests/unit/test_native_*.py` hold the two to the same answers. The GIL is released for
//! all block work, and work on independent blocks is spread over the cores with rayon.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::os::unix::io::FromRawFd;
use std::mem::ManuallyDrop;

use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use rayon::prelude::*;

mod xzstream;

const BLOCK: usize = 4096;
const HASH: usize = 32;
const RECORD: usize = 8 + HASH;
/// Blocks one rayon task hashes (256 KiB): small enough to spread a batch over the cores, large
/// enough that scheduling costs nothing next to the hashing.
const TASK_BLOCKS: usize = 64;
static ZERO: [u8; BLOCK] = [0u8; BLOCK];

create_exception!(capsule_native, ShortRead, PyOSError, "The file ended before the requested range.");

/// An I/O error as Python's OSError with its errno (so a full disk is ENOSPC to the caller, as from os.write).
fn io_err(e: std::io::Error) -> PyErr {
    match e.raw_os_error() {
        Some(code) => PyOSError::new_err((code, e.to_string())),
        None => PyOSError::new_err(e.to_string()),
    }
}
create_exception!(capsule_native, ZstdError, PyValueError, "A zstd payload could not be decoded.");

/// A read-only view of a Python buffer that may cross into a GIL-free section.
struct View {
    ptr: *const u8,
    len: usize,
}
unsafe impl Send for View {}
unsafe impl Sync for View {}

impl View {
    fn of(buf: &PyBuffer<u8>) -> PyResult<View> {
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("buffer must be C-contiguous"));
        }
        Ok(View { ptr: buf.buf_ptr() as *const u8, len: buf.len_bytes() })
    }
    /// Safety: the PyBuffer this came from is alive (it pins the memory) for the slice's life.
    fn slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

fn is_zero(data: &[u8]) -> bool {
    data.len() <= BLOCK && data == &ZERO[..data.len()] || data.len() > BLOCK && data.iter().all(|&b| b == 0)
}

/// BLAKE3 of one block, zero-padded to a full block if short.
fn hash_block(data: &[u8]) -> [u8; HASH] {
    if data.len() == BLOCK {
        return *blake3::hash(data).as_bytes();
    }
    let mut padded = [0u8; BLOCK];
    padded[..data.len()].copy_from_slice(data);
    *blake3::hash(&padded).as_bytes()
}

// -- BLAKE3 of many blocks at once ------------------------------------------------------------------
// blake3::hash of one 4 KiB block (a tree of four 1 KiB chunks) fills four SIMD lanes: half of AVX2's
// eight, a quarter of AVX-512's sixteen. Hashing chunk k of up to sixteen blocks in one call, then
// their parents, then their roots, fills them all. This drives the crate's hidden `platform` API (its
// version is pinned in Cargo.toml); each hash is blake3::hash's, as the property tests check against
// the Python `blake3` package.

const CHUNK: usize = 1024;
const CHUNKS: usize = BLOCK / CHUNK;
const LANES: usize = 16;
const IV: [u32; 8] = [0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19];
const CHUNK_START: u8 = 1;
const CHUNK_END: u8 = 2;
const PARENT: u8 = 4;
const ROOT: u8 = 8;
static ZERO_PAIR: [u8; 2 * HASH] = [0u8; 2 * HASH];

/// The hash of each block of `blocks` (as `hash_block`: a short block zero-padded) into `out`, 32
/// bytes each. One thread; callers spread tasks of blocks over the cores.
fn hash_many_blocks(blocks: &[&[u8]], out: &mut [u8]) {
    let platform = blake3::platform::Platform::detect();
    let mut full: Vec<(usize, &[u8; BLOCK])> = Vec::with_capacity(blocks.len());
    for (i, b) in blocks.iter().enumerate() {
        match <&[u8; BLOCK]>::try_from(*b) {
            Ok(f) => full.push((i, f)),
            Err(_) => out[i * HASH..(i + 1) * HASH].copy_from_slice(&hash_block(b)),
        }
    }
    let mut cv = [0u8; LANES * HASH];
    let mut chunk_cvs = [0u8; LANES * CHUNKS * HASH]; // per block its four chunk CVs, side by side
    let mut parent_cvs = [0u8; LANES * 2 * HASH];     // per block its two parents' CVs, side by side
    for group in full.chunks(LANES) {
        let n = group.len();
        for k in 0..CHUNKS {
            let mut inputs: [&[u8; CHUNK]; LANES] = [&ZERO_CHUNK; LANES];
            for (slot, (_, b)) in inputs.iter_mut().zip(group) {
                *slot = b[k * CHUNK..(k + 1) * CHUNK].try_into().unwrap();
            }
            platform.hash_many(&inputs[..n], &IV, k as u64, blake3::IncrementCounter::No, 0, CHUNK_START, CHUNK_END,
                               &mut cv[..n * HASH]);
            for j in 0..n {
                let at = (j * CHUNKS + k) * HASH;
                chunk_cvs[at..at + HASH].copy_from_slice(&cv[j * HASH..(j + 1) * HASH]);
            }
        }
        let mut pairs: [&[u8; 2 * HASH]; 2 * LANES] = [&ZERO_PAIR; 2 * LANES];
        for (j, slot) in pairs[..2 * n].iter_mut().enumerate() {
            *slot = chunk_cvs[j * 2 * HASH..(j + 1) * 2 * HASH].try_into().unwrap();
        }
        platform.hash_many(&pairs[..2 * n], &IV, 0, blake3::IncrementCounter::No, PARENT, 0, 0,
                           &mut parent_cvs[..2 * n * HASH]);
        let mut tops: [&[u8; 2 * HASH]; LANES] = [&ZERO_PAIR; LANES];
        for (j, slot) in tops[..n].iter_mut().enumerate() {
            *slot = parent_cvs[j * 2 * HASH..(j + 1) * 2 * HASH].try_into().unwrap();
        }
        platform.hash_many(&tops[..n], &IV, 0, blake3::IncrementCounter::No, PARENT | ROOT, 0, 0, &mut cv[..n * HASH]);
        for (j, (i, _)) in group.iter().enumerate() {
            out[i * HASH..(i + 1) * HASH].copy_from_slice(&cv[j * HASH..(j + 1) * HASH]);
        }
    }
}

static ZERO_CHUNK: [u8; CHUNK] = [0u8; CHUNK];

/// The hash of each 4 KiB piece of `data` (the last maybe short: zero-padded), 32 bytes each. One thread.
fn hash_pieces(data: &[u8]) -> Vec<u8> {
    let blocks: Vec<&[u8]> = data.chunks(BLOCK).collect();
    let mut out = vec![0u8; blocks.len() * HASH];
    hash_many_blocks(&blocks, &mut out);
    out
}

/// Per block of `data` (4 KiB pieces, the last maybe short): None for an all-zero block, else its
/// hash. One thread.
fn scan_seq(data: &[u8]) -> Vec<Option<[u8; HASH]>> {
    let blocks: Vec<&[u8]> = data.chunks(BLOCK).collect();
    let nonzero: Vec<usize> = (0..blocks.len()).filter(|&i| !is_zero(blocks[i])).collect();
    let refs: Vec<&[u8]> = nonzero.iter().map(|&i| blocks[i]).collect();
    let mut hashes = vec![0u8; refs.len() * HASH];
    hash_many_blocks(&refs, &mut hashes);
    let mut out = vec![None; blocks.len()];
    for (k, &i) in nonzero.iter().enumerate() {
        out[i] = Some(hashes[k * HASH..(k + 1) * HASH].try_into().unwrap());
    }
    out
}

/// Per block of `data`: None for an all-zero block, else its hash. Parallel over the cores.
fn scan(data: &[u8]) -> Vec<Option<[u8; HASH]>> {
    data.par_chunks(TASK_BLOCKS * BLOCK).map(scan_seq).collect::<Vec<_>>().concat()
}

/// Manifest records (u64 LE `index<<1|zero`, 32-byte hash) of consecutive blocks from `first`.
fn records_into(out: &mut Vec<u8>, first: u64, scanned: &[Option<[u8; HASH]>], zero_flag: bool) {
    for (i, h) in scanned.iter().enumerate() {
        let index = first + i as u64;
        match h {
            Some(h) => {
                out.extend_from_slice(&(index << 1).to_le_bytes());
                out.extend_from_slice(h);
            }
            None if zero_flag => {
                out.extend_from_slice(&(index << 1 | 1).to_le_bytes());
                out.extend_from_slice(&[0u8; HASH]);
            }
            None => {}
        }
    }
}

/// ``hash_blocks(buf) -> bytes``: the 32-byte hash of every block of ``buf``, concatenated (the last
/// block zero-padded if short). Reference: ``hashcache.blocks.hash_blocks``.
#[pyfunction]
fn hash_blocks<'py>(py: Python<'py>, buf: PyBuffer<u8>) -> PyResult<Bound<'py, PyBytes>> {
    let view = View::of(&buf)?;
    let out = py.allow_threads(|| {
        let data = view.slice();
        let chunks: Vec<&[u8]> = data.chunks(BLOCK).collect();
        let mut out = vec![0u8; chunks.len() * HASH];
        out.par_chunks_mut(TASK_BLOCKS * HASH).zip(chunks.par_chunks(TASK_BLOCKS)).for_each(|(o, c)| {
            hash_many_blocks(c, o);
        });
        out
    });
    Ok(PyBytes::new_bound(py, &out))
}

/// ``scan_blocks(buf) -> list[bytes | None]``. Reference: ``hashcache.blocks.scan_blocks``.
#[pyfunction]
fn scan_blocks<'py>(py: Python<'py>, buf: PyBuffer<u8>) -> PyResult<Bound<'py, PyList>> {
    let view = View::of(&buf)?;
    let scanned = py.allow_threads(|| scan(view.slice()));
    let items: Vec<PyObject> = scanned
        .iter()
        .map(|h| match h {
            Some(h) => PyBytes::new_bound(py, h).into_any().unbind(),
            None => py.None(),
        })
        .collect();
    Ok(PyList::new_bound(py, items))
}

/// ``scan_records(buf, first, zero_flag) -> bytes``: manifest records of the blocks of ``buf``,
/// numbered from ``first``; an all-zero block is flagged (``zero_flag``, a layer) or left out (a
/// file). Reference: ``scan_blocks`` + ``hashcache.manifest._RecordBuilder.add_hashes``.
#[pyfunction]
fn scan_records<'py>(py: Python<'py>, buf: PyBuffer<u8>, first: u64, zero_flag: bool) -> PyResult<Bound<'py, PyBytes>> {
    let view = View::of(&buf)?;
    let out = py.allow_threads(|| {
        let scanned = scan(view.slice());
        let mut out = Vec::with_capacity(scanned.len() * RECORD);
        records_into(&mut out, first, &scanned, zero_flag);
        out
    });
    Ok(PyBytes::new_bound(py, &out))
}

/// ``file_records(fd, start, end, zero_flag) -> bytes``: records of the blocks of the byte range
/// ``[start, end)`` of an open file (``start`` block-aligned), read with pread in 1 MiB pieces by
/// all cores. Raises ShortRead if the file ends before ``end``. Reference: the loop of
/// ``hashcache.manifest.manifest_of_file``.
#[pyfunction]
fn file_records<'py>(py: Python<'py>, fd: i32, start: u64, end: u64, zero_flag: bool) -> PyResult<Bound<'py, PyBytes>> {
    if start % BLOCK as u64 != 0 || end < start {
        return Err(PyValueError::new_err(format!("bad range {start}..{end}")));
    }
    const PIECE: u64 = 1 << 20;
    let out = py.allow_threads(|| -> Result<Vec<u8>, std::io::Error> {
        // Borrow the caller's descriptor without taking ownership of it.
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let pieces: Vec<u64> = (start..end).step_by(PIECE as usize).collect();
        let parts: Vec<Result<Vec<u8>, std::io::Error>> = pieces
            .par_iter()
            .map(|&off| {
                let n = (end - off).min(PIECE) as usize;
                let mut buf = vec![0u8; n];
                file.read_exact_at(&mut buf, off)?;
                let mut out = Vec::with_capacity(n / BLOCK * RECORD + RECORD);
                records_into(&mut out, off / BLOCK as u64, &scan_seq(&buf), zero_flag);
                Ok(out)
            })
            .collect();
        let mut out = Vec::new();
        for p in parts {
            out.extend_from_slice(&p?);
        }
        Ok(out)
    });
    match out {
        Ok(v) => Ok(PyBytes::new_bound(py, &v)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(ShortRead::new_err("file ended early")),
        Err(e) => Err(io_err(e)),
    }
}

// -- qcow2 layers (hashcache/qcow2.py, manifest.py) --------------------------------------------------

const L2_COMPRESSED: u64 = 1 << 62;
const L2_ZERO: u64 = 1;
const L2_RESERVED: u64 = 0x3F00_0000_0000_01FE;
const OFFSET_MASK: u64 = 0x00FF_FFFF_FFFF_FE00;
const SC_ALL: u64 = 0xFFFF_FFFF;
/// Blocks one task reads and hashes at most (1 MiB).
const RUN_BLOCKS: u64 = 256;
/// The largest host span one task reads with a single pread (8 MiB).
const SPAN_BYTES: u64 = 8 << 20;

/// The geometry of one qcow2 file, as ``hashcache.qcow2.Qcow2Image`` read and checked it.
#[derive(Clone, Copy)]
struct Geometry {
    extended: bool,
    cluster_size: u64,
    subcluster_size: u64,
    block_count: u64,
    virtual_size: u64,
    file_size: u64,
}

/// A run of a layer's own blocks: ``host`` None for blocks that read as zero.
struct Run {
    start: u64,
    count: u64,
    host: Option<u64>,
}

/// The runs one L2 table allocates (clipped to the disk, adjacent data merged up to RUN_BLOCKS), or
/// Err(()) at anything the reference refuses (compressed, reserved bits, misaligned, contradictory
/// bitmaps, data past the file's end): the caller then asks the reference, which names it.
fn table_runs(table: &[u8], base_cluster: u64, n_entries: usize, g: Geometry) -> Result<Vec<Run>, ()> {
    let word = |k: usize| u64::from_be_bytes(table[k * 8..k * 8 + 8].try_into().unwrap());
    let per_cluster = g.cluster_size / BLOCK as u64;
    let per_sc = g.subcluster_size / BLOCK as u64;
    let mut runs: Vec<Run> = Vec::new();
    let mut push = |start: u64, count: u64, host: Option<u64>| -> Result<(), ()> {
        if start >= g.block_count {
            return Ok(());
        }
        let count = count.min(g.block_count - start);
        if let Some(h) = host {
            let guest = ((start + count) * BLOCK as u64).min(g.virtual_size) - start * BLOCK as u64;
            if h + guest > g.file_size {
                return Err(());
            }
        }
        if let Some(last) = runs.last_mut() {
            let adjacent = last.start + last.count == start && last.count + count <= RUN_BLOCKS;
            let same = match (last.host, host) {
                (None, None) => true,
                (Some(a), Some(b)) => a + last.count * BLOCK as u64 == b,
                _ => false,
            };
            if adjacent && same {
                last.count += count;
                return Ok(());
            }
        }
        runs.push(Run { start, count, host });
        Ok(())
    };
    for i in 0..n_entries {
        let (entry, bitmap) = if g.extended { (word(2 * i), word(2 * i + 1)) } else { (word(i), 0) };
        if entry == 0 && bitmap == 0 {
            continue;
        }
        if entry & (L2_COMPRESSED | L2_RESERVED) != 0 {
            return Err(());
        }
        let host = entry & OFFSET_MASK;
        if host % g.cluster_size != 0 {
            return Err(());
        }
        let first = (base_cluster + i as u64) * per_cluster;
        if !g.extended {
            if entry & L2_ZERO != 0 {
                push(first, per_cluster, None)?;
            } else if host != 0 {
                push(first, per_cluster, Some(host))?;
            }
            continue;
        }
        let (alloc, zero) = (bitmap & SC_ALL, bitmap >> 32);
        if alloc & zero != 0 || (alloc != 0 && host == 0) {
            return Err(());
        }
        for sc in 0..32u64 {
            if alloc >> sc & 1 == 1 {
                push(first + sc * per_sc, per_sc, Some(host + sc * g.subcluster_size))?;
            } else if zero >> sc & 1 == 1 {
                push(first + sc * per_sc, per_sc, None)?;
            }
        }
    }
    Ok(runs)
}

/// ``layer_table_records(fd, table, base_cluster, n_entries, extended, cluster_size, subcluster_size,
/// block_count, virtual_size, file_size) -> bytes | None``: the manifest records (key, hash; zero
/// blocks flagged) of every block one L2 table of a qcow2 file allocates, in guest order: the
/// table walked, data read with pread and hashed on every core. None when the table or the data
/// is anything the reference would refuse or fail on (the caller runs the reference, which names
/// it). Reference: ``hashcache.manifest._reference_manifest_of_layer`` (``Qcow2Image.iter_block_runs``
/// + ``scan_records``).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn layer_table_records<'py>(py: Python<'py>, fd: i32, table: &[u8], base_cluster: u64, n_entries: usize,
                            extended: bool, cluster_size: u64, subcluster_size: u64, block_count: u64,
                            virtual_size: u64, file_size: u64) -> PyResult<Option<Bound<'py, PyBytes>>> {
    let g = Geometry { extended, cluster_size, subcluster_size, block_count, virtual_size, file_size };
    let words = if extended { 2 * n_entries } else { n_entries };
    if table.len() < words * 8 || cluster_size % BLOCK as u64 != 0 || cluster_size == 0
        || subcluster_size % BLOCK as u64 != 0 || subcluster_size == 0
        || (extended && subcluster_size * 32 != cluster_size) || (!extended && subcluster_size != cluster_size) {
        return Err(PyValueError::new_err("layer_table_records: table or geometry is malformed"));
    }
    let tv = View { ptr: table.as_ptr(), len: table.len() };
    let out = py.allow_threads(move || -> Option<Vec<u8>> {
        let runs = table_runs(tv.slice(), base_cluster, n_entries, g).ok()?;
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        // Tasks of whole runs, about RUN_BLOCKS blocks each (a run is at most that long). A task's data
        // is gathered into one buffer, block-aligned per run (a short last block zero-padded), from
        // one pread of the host span it lies in when that is small (a cluster's subclusters sit side
        // by side), else one pread per run; then zero-checked and hashed many blocks at a time.
        let mut tasks: Vec<&[Run]> = Vec::new();
        let (mut first, mut blocks) = (0, 0u64);
        for (k, r) in runs.iter().enumerate() {
            blocks += r.count;
            if blocks >= RUN_BLOCKS || k + 1 == runs.len() {
                tasks.push(&runs[first..=k]);
                (first, blocks) = (k + 1, 0);
            }
        }
        let parts: Vec<Option<Vec<u8>>> = tasks
            .par_iter()
            .map(|task| {
                let guest = |r: &Run| (((r.start + r.count) * BLOCK as u64).min(g.virtual_size) - r.start * BLOCK as u64) as usize;
                let data: Vec<&Run> = task.iter().filter(|r| r.host.is_some()).collect();
                let lo = data.iter().map(|r| r.host.unwrap()).min().unwrap_or(0);
                let hi = data.iter().map(|r| r.host.unwrap() + guest(r) as u64).max().unwrap_or(0);
                let span = if !data.is_empty() && hi - lo <= SPAN_BYTES {
                    let mut buf = vec![0u8; (hi - lo) as usize];
                    file.read_exact_at(&mut buf, lo).ok()?;
                    Some(buf)
                } else {
                    None
                };
                let mut gathered = vec![0u8; data.iter().map(|r| r.count as usize * BLOCK).sum()];
                let mut at = 0;
                for r in &data {
                    let (h, n) = (r.host.unwrap(), guest(r));
                    match &span {
                        Some(buf) => gathered[at..at + n].copy_from_slice(&buf[(h - lo) as usize..(h - lo) as usize + n]),
                        None => file.read_exact_at(&mut gathered[at..at + n], h).ok()?,
                    }
                    at += r.count as usize * BLOCK;
                }
                let scanned = scan_seq(&gathered);
                let mut out = Vec::with_capacity(task.iter().map(|r| r.count as usize).sum::<usize>() * RECORD);
                let mut next = 0;
                for r in task.iter() {
                    let count = r.count as usize;
                    if r.host.is_some() {
                        records_into(&mut out, r.start, &scanned[next..next + count], true);
                        next += count;
                    } else {
                        records_into(&mut out, r.start, &vec![None; count], true);
                    }
                }
                Some(out)
            })
            .collect();
        let mut out = Vec::with_capacity(parts.iter().map(|p| p.as_ref().map_or(0, |v| v.len())).sum());
        for p in parts {
            out.extend_from_slice(&p?);
        }
        Some(out)
    });
    Ok(out.map(|v| PyBytes::new_bound(py, &v)))
}

/// ``blake3_file(path) -> bytes``: BLAKE3 of a whole file (memory-mapped, all cores): the peer the
/// benchmarks compare manifest building and ``verify`` with.
#[pyfunction]
fn blake3_file<'py>(py: Python<'py>, path: std::path::PathBuf) -> PyResult<Bound<'py, PyBytes>> {
    let digest = py.allow_threads(|| -> std::io::Result<[u8; HASH]> {
        let file = File::open(&path)?;
        let len = file.metadata()?.len();
        let mut h = blake3::Hasher::new();
        if len > 0 {
            let map = unsafe { memmap2::Mmap::map(&file)? };
            h.update_rayon(&map);
        }
        Ok(*h.finalize().as_bytes())
    });
    Ok(PyBytes::new_bound(py, &digest.map_err(|e| io_err(e))?))
}

/// ``verify_blocks(buf, expected, hash_len) -> int``: the position of the first block of ``buf``
/// whose hash does not start with its ``hash_len``-byte slice of ``expected``, or -1 if all match.
/// Reference: the check in ``hashcache.hcp.Receiver.accept``.
#[pyfunction]
fn verify_blocks(py: Python<'_>, buf: PyBuffer<u8>, expected: &[u8], hash_len: usize) -> PyResult<i64> {
    let view = View::of(&buf)?;
    if hash_len == 0 || hash_len > HASH || view.len % BLOCK != 0 || expected.len() != view.len / BLOCK * hash_len {
        return Err(PyValueError::new_err("verify_blocks: buffer and expected hashes do not match in length"));
    }
    let exp = View { ptr: expected.as_ptr(), len: expected.len() };
    Ok(py.allow_threads(|| {
        let data = view.slice();
        let want = exp.slice();
        data.par_chunks(TASK_BLOCKS * BLOCK)
            .enumerate()
            .find_map_first(|(t, task)| {
                let got = hash_pieces(task);
                (0..got.len() / HASH)
                    .find(|&k| got[k * HASH..k * HASH + hash_len] != want[(t * TASK_BLOCKS + k) * hash_len..(t * TASK_BLOCKS + k + 1) * hash_len])
                    .map(|k| t * TASK_BLOCKS + k)
            })
            .map_or(-1, |i| i as i64)
    }))
}

/// ``compress(raw, level) -> bytes``: one zstd frame (content size recorded, no checksum), as
/// ``zstandard.ZstdCompressor(level=level).compress(raw)`` makes it.
#[pyfunction]
fn compress<'py>(py: Python<'py>, raw: PyBuffer<u8>, level: i32) -> PyResult<Bound<'py, PyBytes>> {
    let view = View::of(&raw)?;
    let out = py.allow_threads(|| zstd::bulk::compress(view.slice(), level));
    Ok(PyBytes::new_bound(py, &out.map_err(|e| PyValueError::new_err(e.to_string()))?))
}

/// ``compress_many(parts, level) -> list[bytes]``: :func:`compress` of each part, all cores.
#[pyfunction]
fn compress_many<'py>(py: Python<'py>, parts: Vec<PyBuffer<u8>>, level: i32) -> PyResult<Bound<'py, PyList>> {
    let views = parts.iter().map(View::of).collect::<PyResult<Vec<View>>>()?;
    let outs = py.allow_threads(|| {
        views.par_iter().map(|v| zstd::bulk::compress(v.slice(), level)).collect::<Vec<_>>()
    });
    let mut items = Vec::with_capacity(outs.len());
    for o in outs {
        items.push(PyBytes::new_bound(py, &o.map_err(|e| PyValueError::new_err(e.to_string()))?));
    }
    Ok(PyList::new_bound(py, items))
}

fn decompress_one(payload: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    // The first frame only, as python-zstandard's ``ZstdDecompressor.decompress`` reads a payload.
    let end = zstd::zstd_safe::find_frame_compressed_size(payload).map_err(|c| zstd::zstd_safe::get_error_name(c).to_string())?;
    let mut d = zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?;
    d.decompress(&payload[..end], limit).map_err(|e| e.to_string())
}

// -- one zstd stream across the batches of one object (hashcache/hcp.py: StreamPacker) ---------------
// Each batch is compressed as a flushed segment of one stream, so later batches match earlier ones (one
// context per object instead of one frame per batch). The receiver decodes the segments in order.

/// The window both ends use (8 MiB, zstd -19's own); the decoder refuses anything larger.
const STREAM_WINDOW_LOG: u32 = 23;

fn zstd_err(e: std::io::Error) -> PyErr {
    ZstdError::new_err(e.to_string())
}

/// ``StreamEncoder(level)``; ``segment(raw) -> bytes``: ``raw`` compressed and flushed, decodable once
/// every segment before it has been.
#[pyclass]
struct StreamEncoder {
    enc: zstd::stream::raw::Encoder<'static>,
}

#[pymethods]
impl StreamEncoder {
    #[new]
    fn new(level: i32) -> PyResult<Self> {
        use zstd::stream::raw::CParameter;
        let mut enc = zstd::stream::raw::Encoder::new(level).map_err(zstd_err)?;
        enc.set_parameter(CParameter::WindowLog(STREAM_WINDOW_LOG)).map_err(zstd_err)?;
        Ok(Self { enc })
    }

    fn segment<'py>(&mut self, py: Python<'py>, raw: PyBuffer<u8>) -> PyResult<Bound<'py, PyBytes>> {
        use zstd::stream::raw::{InBuffer, Operation, OutBuffer};
        let view = View::of(&raw)?;
        let enc = &mut self.enc;
        let out = py.allow_threads(move || -> std::io::Result<Vec<u8>> {
            let data = view.slice();
            let mut out: Vec<u8> = Vec::with_capacity(zstd::zstd_safe::compress_bound(data.len()) + 64);
            let mut input = InBuffer::around(data);
            while input.pos() < data.len() {
                if out.capacity() - out.len() < 64 {
                    out.reserve(out.capacity().max(1 << 16));
                }
                let at = out.len();
                enc.run(&mut input, &mut OutBuffer::around_pos(&mut out, at))?;
            }
            loop {
                if out.capacity() - out.len() < 64 {
                    out.reserve(out.capacity().max(1 << 16));
                }
                let at = out.len();
                if enc.flush(&mut OutBuffer::around_pos(&mut out, at))? == 0 {
                    break;
                }
            }
            Ok(out)
        });
        Ok(PyBytes::new_bound(py, &out.map_err(zstd_err)?))
    }
}

/// ``StreamDecoder()``; ``segment(payload, size) -> bytes``: the next segment decoded, exactly ``size``
/// bytes; ZstdError if it is not zstd, needs a window over 8 MiB, or decodes to more or fewer bytes.
/// After an error the stream cannot go on (the caller drops it).
#[pyclass]
struct StreamDecoder {
    dec: zstd::stream::raw::Decoder<'static>,
}

#[pymethods]
impl StreamDecoder {
    #[new]
    fn new() -> PyResult<Self> {
        use zstd::stream::raw::DParameter;
        let mut dec = zstd::stream::raw::Decoder::new().map_err(zstd_err)?;
        dec.set_parameter(DParameter::WindowLogMax(STREAM_WINDOW_LOG)).map_err(zstd_err)?;
        Ok(Self { dec })
    }

    fn segment<'py>(&mut self, py: Python<'py>, payload: PyBuffer<u8>, size: usize) -> PyResult<Bound<'py, PyBytes>> {
        use zstd::stream::raw::{InBuffer, Operation, OutBuffer};
        let view = View::of(&payload)?;
        let dec = &mut self.dec;
        let out = py.allow_threads(move || -> Result<Vec<u8>, String> {
            let data = view.slice();
            let mut out = vec![0u8; size + 1]; // one byte more than promised: a longer segment is caught
            let mut input = InBuffer::around(data);
            let mut written = 0;
            loop {
                let before = (input.pos(), written);
                let mut output = OutBuffer::around_pos(&mut out[..], written);
                dec.run(&mut input, &mut output).map_err(|e| e.to_string())?;
                written = output.pos();
                if written > size {
                    return Err(format!("a stream segment decodes to more than the {size} bytes announced"));
                }
                if (input.pos(), written) == before {
                    break;
                }
            }
            if input.pos() < data.len() || written != size {
                return Err(format!("a stream segment decodes to {written} bytes, not the {size} announced"));
            }
            out.truncate(size);
            Ok(out)
        });
        Ok(PyBytes::new_bound(py, &out.map_err(ZstdError::new_err)?))
    }
}

/// ``decompress(payload, limit) -> bytes``: the first zstd frame of ``payload`` decoded (what
/// follows it is ignored, as python-zstandard does); more than ``limit`` bytes of output, or
/// anything that is not zstd, raises ZstdError.
#[pyfunction]
fn decompress<'py>(py: Python<'py>, payload: PyBuffer<u8>, limit: usize) -> PyResult<Bound<'py, PyBytes>> {
    let view = View::of(&payload)?;
    let out = py.allow_threads(|| decompress_one(view.slice(), limit));
    Ok(PyBytes::new_bound(py, &out.map_err(ZstdError::new_err)?))
}

/// ``pwrite_runs(fd, indices, data, durable)``: block ``indices[k]`` of the file gets bytes
/// ``data[k*4096 : (k+1)*4096]``; one pwrite per run of adjacent indices, then fdatasync if
/// ``durable``. Reference: ``hashcache.shadow.Shadow.store`` (which then sets presence bits).
#[pyfunction]
fn pwrite_runs(py: Python<'_>, fd: i32, indices: Vec<u64>, data: PyBuffer<u8>, durable: bool) -> PyResult<()> {
    let view = View::of(&data)?;
    if view.len != indices.len() * BLOCK {
        return Err(PyValueError::new_err("pwrite_runs: data is not one block per index"));
    }
    let res = py.allow_threads(|| -> std::io::Result<()> {
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let bytes = view.slice();
        let mut order: Vec<usize> = (0..indices.len()).collect();
        order.sort_by_key(|&k| indices[k]);
        let mut run: Vec<u8> = Vec::new();
        let mut pos = 0;
        while pos < order.len() {
            let mut end = pos + 1;
            while end < order.len() && indices[order[end]] == indices[order[pos]] + (end - pos) as u64 {
                end += 1;
            }
            run.clear();
            for &k in &order[pos..end] {
                run.extend_from_slice(&bytes[k * BLOCK..(k + 1) * BLOCK]);
            }
            file.write_all_at(&run, indices[order[pos]] * BLOCK as u64)?;
            pos = end;
        }
        if durable {
            file.sync_data()?;
        }
        Ok(())
    });
    res.map_err(|e| io_err(e))
}

// -- the hash cache's table (hashcache/cache/format.py, table.py) -----------------------------------

const BUCKET: usize = 4096;
const ENTRY: usize = 32;
const KEY: usize = 8;

fn crc32(data: &[u8]) -> u32 {
    // zlib's CRC-32 (IEEE 802.3, reflected), bit by bit over 20-byte entry heads: cheap enough.
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (!(crc & 1)).wrapping_add(1));
        }
    }
    !crc
}

/// ``cache_candidates(table, bucket_count, buckets_offset, prefixes) -> bytes``: per 8-byte hash
/// prefix, the first intact entry of its bucket whose key matches (slot order), as 24 bytes
/// ``i64 position (-1: none), u64 offset, u64 file id``. Reference:
/// ``hashcache.cache.table.BucketTable._candidates`` (its first element).
#[pyfunction]
fn cache_candidates<'py>(py: Python<'py>, table: PyBuffer<u8>, bucket_count: u64, buckets_offset: usize,
                         prefixes: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let view = View::of(&table)?;
    if prefixes.len() % KEY != 0 || view.len < buckets_offset + bucket_count as usize * BUCKET {
        return Err(PyValueError::new_err("cache_candidates: table or prefixes have the wrong size"));
    }
    let pv = View { ptr: prefixes.as_ptr(), len: prefixes.len() };
    let out = py.allow_threads(|| {
        let t = view.slice();
        let ps = pv.slice();
        let mut out = Vec::with_capacity(ps.len() / KEY * 24);
        for p in ps.chunks(KEY) {
            let v = u64::from_be_bytes(p.try_into().unwrap());
            let bucket = ((v as u128 * bucket_count as u128) >> 64) as usize;
            let start = buckets_offset + bucket * BUCKET;
            let key: [u8; KEY] = if v == 0 { [1, 0, 0, 0, 0, 0, 0, 0] } else { p.try_into().unwrap() };
            let mut found: (i64, u64, u64) = (-1, 0, 0);
            for slot in 0..BUCKET / ENTRY {
                let e = &t[start + slot * ENTRY..start + (slot + 1) * ENTRY];
                if e[..KEY] != key {
                    continue;
                }
                let off = u64::from_le_bytes(e[8..16].try_into().unwrap());
                let fid = u32::from_le_bytes(e[16..20].try_into().unwrap());
                let check = u32::from_le_bytes(e[20..24].try_into().unwrap());
                if fid != 0 && crc32(&e[..20]) == check {
                    found = ((start + slot * ENTRY) as i64, off, fid as u64);
                    break;
                }
            }
            out.extend_from_slice(&found.0.to_le_bytes());
            out.extend_from_slice(&found.1.to_le_bytes());
            out.extend_from_slice(&found.2.to_le_bytes());
        }
        out
    });
    Ok(PyBytes::new_bound(py, &out))
}

/// A mutable view of a writable Python buffer (the hash cache's mmap) for a GIL-free section.
struct ViewMut {
    ptr: *mut u8,
    len: usize,
}
unsafe impl Send for ViewMut {}

/// ``cache_put_many(table, bucket_count, buckets_offset, keys, offsets, fids, evict_sample, seed)
/// -> (written, inserts, updates, evictions)``: per (8-byte key, offset, file id), what
/// ``hashcache.cache.table.BucketTable._put`` does, in order: the first slot of the bucket with that
/// key is left alone if it already says this (intact), else re-pointed (its use count kept if
/// intact); without one, an empty slot searched from a random place; in a full bucket the least used
/// of ``evict_sample`` random slots (a torn one first) is evicted. Each entry is written as the
/// reference writes it: key cleared, tail written, key published last (readers in other processes
/// never see a half-written entry as intact). Keys are already ``_key(h)`` (never all zero).
/// Reference: ``BucketTable._put``; ``seed`` drives the random choices (the reference's come from
/// its own generator, so the two agree on what is found, not on which slot holds it).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cache_put_many(py: Python<'_>, table: PyBuffer<u8>, bucket_count: u64, buckets_offset: usize, keys: &[u8],
                  offsets: Vec<u64>, fids: Vec<u32>, evict_sample: usize, seed: u64)
                  -> PyResult<(u64, u64, u64, u64)> {
    if table.readonly() || !table.is_c_contiguous() {
        return Err(PyValueError::new_err("cache_put_many: the table must be a writable contiguous buffer"));
    }
    let view = ViewMut { ptr: table.buf_ptr() as *mut u8, len: table.len_bytes() };
    if view.len < buckets_offset + bucket_count as usize * BUCKET || bucket_count == 0
        || keys.len() != offsets.len() * KEY || fids.len() != offsets.len()
        || !(1..=BUCKET / ENTRY).contains(&evict_sample)
        || keys.chunks(KEY).any(|k| k == [0u8; KEY]) || fids.contains(&0) {
        return Err(PyValueError::new_err("cache_put_many: table, keys, offsets or file ids are malformed"));
    }
    let kv = View { ptr: keys.as_ptr(), len: keys.len() };
    Ok(py.allow_threads(move || {
        let view = view;
        let t = unsafe { std::slice::from_raw_parts_mut(view.ptr, view.len) };
        let ks = kv.slice();
        let mut rng = seed | 1;
        let mut next7 = move || {
            // xorshift64*: the slot numbers the reference draws with getrandbits(7)
            rng ^= rng >> 12;
            rng ^= rng << 25;
            rng ^= rng >> 27;
            (rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 57) as usize
        };
        let (mut written, mut inserts, mut updates, mut evictions) = (0u64, 0u64, 0u64, 0u64);
        let slots = BUCKET / ENTRY;
        for (n, key) in ks.chunks(KEY).enumerate() {
            let (off, fid) = (offsets[n], fids[n]);
            let v = u64::from_be_bytes(key.try_into().unwrap());
            let start = buckets_offset + ((v as u128 * bucket_count as u128) >> 64) as usize * BUCKET;
            let mut head = [0u8; 20];
            head[..KEY].copy_from_slice(key);
            head[8..16].copy_from_slice(&off.to_le_bytes());
            head[16..20].copy_from_slice(&fid.to_le_bytes());
            let check = crc32(&head);
            let entry_at = |slot: usize| start + slot * ENTRY;
            let intact = |t: &[u8], p: usize| u32::from_le_bytes(t[p + 20..p + 24].try_into().unwrap()) == crc32(&t[p..p + 20]);
            let mut target: Option<(usize, u32)> = None;
            if let Some(slot) = (0..slots).find(|&s| &t[entry_at(s)..entry_at(s) + KEY] == key) {
                let p = entry_at(slot);
                if t[p..p + 20] == head && u32::from_le_bytes(t[p + 20..p + 24].try_into().unwrap()) == check {
                    continue; // already there
                }
                let uses = if intact(t, p) { u32::from_le_bytes(t[p + 24..p + 28].try_into().unwrap()) } else { 0 };
                target = Some((p, uses));
                updates += 1;
            }
            if target.is_none() {
                let first = next7();
                let empty = (first..slots).chain(0..first).find(|&s| t[entry_at(s)..entry_at(s) + KEY] == [0u8; KEY]);
                if let Some(slot) = empty {
                    target = Some((entry_at(slot), 0));
                } else {
                    let sample: Vec<usize> = if evict_sample >= slots { (0..slots).collect() }
                                             else { (0..evict_sample).map(|_| next7()).collect() };
                    let mut best: (usize, u64) = (usize::MAX, u64::MAX);
                    for s in sample {
                        let p = entry_at(s);
                        if !intact(t, p) {
                            best = (p, 0);
                            break;
                        }
                        let uses = u32::from_le_bytes(t[p + 24..p + 28].try_into().unwrap()) as u64;
                        if uses < best.1 {
                            best = (p, uses);
                        }
                    }
                    target = Some((best.0, 0));
                    evictions += 1;
                }
                inserts += 1;
            }
            let (p, uses) = target.unwrap();
            // key cleared, tail written, key published last (as table.py's _write_entry)
            t[p..p + KEY].copy_from_slice(&[0u8; KEY]);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            t[p + 8..p + 16].copy_from_slice(&off.to_le_bytes());
            t[p + 16..p + 20].copy_from_slice(&fid.to_le_bytes());
            t[p + 20..p + 24].copy_from_slice(&check.to_le_bytes());
            t[p + 24..p + 28].copy_from_slice(&uses.to_le_bytes());
            t[p + 28..p + 32].copy_from_slice(&[0u8; 4]);
            std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
            t[p..p + KEY].copy_from_slice(key);
            written += 1;
        }
        (written, inserts, updates, evictions)
    }))
}

/// ``cache_bump_uses(table, positions)``: one more use for each entry at ``positions`` (byte offsets
/// of entries in the table, 32-byte aligned, within it), saturating. Reference:
/// ``hashcache.cache.table.BucketTable._bump_uses``, once per position.
#[pyfunction]
fn cache_bump_uses(table: PyBuffer<u8>, positions: Vec<usize>) -> PyResult<()> {
    if table.readonly() || !table.is_c_contiguous() {
        return Err(PyValueError::new_err("cache_bump_uses: the table must be a writable contiguous buffer"));
    }
    let len = table.len_bytes();
    if positions.iter().any(|&p| p % ENTRY != 0 || p + ENTRY > len) {
        return Err(PyValueError::new_err("cache_bump_uses: a position is not an entry of the table"));
    }
    let t = unsafe { std::slice::from_raw_parts_mut(table.buf_ptr() as *mut u8, len) };
    for p in positions {
        let uses = u32::from_le_bytes(t[p + 24..p + 28].try_into().unwrap());
        if uses < u32::MAX {
            t[p + 24..p + 28].copy_from_slice(&(uses + 1).to_le_bytes());
        }
    }
    Ok(())
}

/// ``read_verified(fd, offsets, prefixes) -> list[tuple[bytes, bytes] | None]``: per offset of an
/// open file, the 4 KiB block there (a short last block zero-padded) and its BLAKE3 hash if that
/// hash starts with the offset's 8-byte prefix; None otherwise (mismatch, beyond the end, or a read
/// error: the caller asks the reference path, which tells these apart). Reads and hashes on every
/// core. Reference: ``hashcache.cache.lookup.VerifiedLookup._read_verified``.
#[pyfunction]
fn read_verified<'py>(py: Python<'py>, fd: i32, offsets: Vec<u64>, prefixes: &[u8]) -> PyResult<Bound<'py, PyList>> {
    if prefixes.len() != offsets.len() * KEY {
        return Err(PyValueError::new_err("read_verified: one 8-byte prefix per offset"));
    }
    let pv = View { ptr: prefixes.as_ptr(), len: prefixes.len() };
    // Per task of up to 64 offsets: one buffer, one pread per run of adjacent offsets.
    type Task = (Vec<u8>, Vec<Option<[u8; HASH]>>);
    let parts: Vec<Task> = py.allow_threads(|| {
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let ps = pv.slice();
        offsets
            .par_chunks(TASK_BLOCKS)
            .enumerate()
            .map(|(t, offs)| {
                let mut buf = vec![0u8; offs.len() * BLOCK];
                let mut readable = vec![false; offs.len()];
                let mut k = 0;
                while k < offs.len() {
                    let mut end = k + 1;
                    while end < offs.len() && offs[end] == offs[k] + ((end - k) * BLOCK) as u64 {
                        end += 1;
                    }
                    let run = &mut buf[k * BLOCK..end * BLOCK];
                    let mut got = 0;
                    while got < run.len() {
                        match file.read_at(&mut run[got..], offs[k] + got as u64) {
                            Ok(0) => break,
                            Ok(n) => got += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(_) => break, // blocks not read are reported as not found
                        }
                    }
                    for (j, r) in readable[k..end].iter_mut().enumerate() {
                        *r = got > j * BLOCK;
                    }
                    k = end;
                }
                let all = hash_pieces(&buf);
                let hashes = (0..offs.len())
                    .map(|k| {
                        let i = t * TASK_BLOCKS + k;
                        let h: [u8; HASH] = all[k * HASH..(k + 1) * HASH].try_into().unwrap();
                        (readable[k] && h[..KEY] == ps[i * KEY..(i + 1) * KEY]).then_some(h)
                    })
                    .collect();
                (buf, hashes)
            })
            .collect()
    });
    let mut items: Vec<PyObject> = Vec::with_capacity(offsets.len());
    for (buf, hashes) in &parts {
        for (k, h) in hashes.iter().enumerate() {
            items.push(match h {
                Some(h) => (PyBytes::new_bound(py, &buf[k * BLOCK..(k + 1) * BLOCK]), PyBytes::new_bound(py, h)).into_py(py),
                None => py.None(),
            });
        }
    }
    Ok(PyList::new_bound(py, items))
}

/// ``hash_at(fd, indices) -> bytes``: BLAKE3 of the 4 KiB block at each index of an open file
/// (beyond its end reads as zero), concatenated; every core. Reference: ``hash_block(shadow.read(i))``.
#[pyfunction]
fn hash_at<'py>(py: Python<'py>, fd: i32, indices: Vec<u64>) -> PyResult<Bound<'py, PyBytes>> {
    let out = py.allow_threads(|| -> std::io::Result<Vec<u8>> {
        let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let mut out = vec![0u8; indices.len() * HASH];
        out.par_chunks_mut(HASH * TASK_BLOCKS).zip(indices.par_chunks(TASK_BLOCKS)).try_for_each(|(o, ix)| {
            let mut buf = vec![0u8; ix.len() * BLOCK];
            for (block, &i) in buf.chunks_mut(BLOCK).zip(ix.iter()) {
                let mut got = 0;
                while got < BLOCK {
                    let k = file.read_at(&mut block[got..], i * BLOCK as u64 + got as u64)?;
                    if k == 0 {
                        break;
                    }
                    got += k;
                }
            }
            o.copy_from_slice(&hash_pieces(&buf));
            Ok::<(), std::io::Error>(())
        })?;
        Ok(out)
    });
    Ok(PyBytes::new_bound(py, &out.map_err(|e| io_err(e))?))
}

#[pymodule]
fn capsule_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("BLOCK_SIZE", BLOCK)?;
    m.add("ShortRead", m.py().get_type_bound::<ShortRead>())?;
    m.add("ZstdError", m.py().get_type_bound::<ZstdError>())?;
    m.add_function(wrap_pyfunction!(hash_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(scan_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(scan_records, m)?)?;
    m.add_function(wrap_pyfunction!(file_records, m)?)?;
    m.add_function(wrap_pyfunction!(blake3_file, m)?)?;
    m.add_function(wrap_pyfunction!(verify_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(compress, m)?)?;
    m.add_function(wrap_pyfunction!(compress_many, m)?)?;
    m.add_function(wrap_pyfunction!(decompress, m)?)?;
    m.add_function(wrap_pyfunction!(pwrite_runs, m)?)?;
    m.add_function(wrap_pyfunction!(cache_candidates, m)?)?;
    m.add_function(wrap_pyfunction!(cache_put_many, m)?)?;
    m.add_function(wrap_pyfunction!(layer_table_records, m)?)?;
    m.add_function(wrap_pyfunction!(cache_bump_uses, m)?)?;
    m.add_function(wrap_pyfunction!(read_verified, m)?)?;
    m.add_function(wrap_pyfunction!(hash_at, m)?)?;
    m.add_class::<StreamEncoder>()?;
    m.add_class::<StreamDecoder>()?;
    xzstream::register(m)?;
    Ok(())
}
