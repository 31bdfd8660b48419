//! Sequential file I/O with `O_DIRECT`: whole aligned 8 MiB blocks through page-aligned
//! buffers, past the page cache — on the NVMe arrays checkpoints go to, buffered writes plus
//! `fsync` reach a fraction of the disk's rate (measured here: 0.36 GB/s buffered + fsync vs
//! 1.6 GB/s direct, `dd`), and buffered reads interleaved over a checkpoint's files less than
//! half of it. Each stream has one I/O thread and two buffers, so the caller's copying and
//! encoding of one block overlaps the disk's transfer of the other (`dd` does one at a time: the
//! limit `megatrain bench io` measures against). Where the filesystem refuses `O_DIRECT` (tmpfs),
//! the same blocks go through the page cache.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Alignment of the buffer, the file offsets and the lengths of direct writes (covers 512 B
/// and 4 KiB logical blocks).
const ALIGN: usize = 4096;
/// Bytes per block (one read or write call).
const BLOCK: usize = 8 << 20;
/// Blocks a reader holds: read ahead while the caller is busy elsewhere (a checkpoint's other
/// files, first touches of fresh memory).
const READ_AHEAD: usize = 4;

/// A page-aligned heap buffer.
#[derive(Debug)]
struct Aligned {
    ptr: *mut u8,
    layout: Layout,
}

impl Aligned {
    fn new(len: usize) -> io::Result<Self> {
        let layout = Layout::from_size_align(len, ALIGN).map_err(io::Error::other)?;
        // SAFETY: the layout has a non-zero size (BLOCK).
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                "allocate the direct-I/O staging buffer",
            ));
        }
        Ok(Aligned { ptr, layout })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `layout.size()` initialised bytes (zeroed by `new`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `layout.size()` bytes, allocated and zeroed by `new`, and
        // `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

/// Blocks kept for reuse once their stream ends: a checkpoint every step would otherwise map,
/// fault in and zero its staging buffers every time (measured: ~2/3 of the writer's CPU time
/// on a small model). Enough for one checkpoint's three files, two blocks each.
const KEEP_BLOCKS: usize = 6;

static FREE_BLOCKS: std::sync::Mutex<Vec<Aligned>> = std::sync::Mutex::new(Vec::new());

impl Aligned {
    /// A [`BLOCK`]-byte buffer, reused if one is free. Its bytes are initialised (zeroes, or
    /// what an earlier stream left: every user writes before it reads).
    fn block() -> io::Result<Self> {
        let reused = FREE_BLOCKS.lock().ok().and_then(|mut v| v.pop());
        match reused {
            Some(b) => Ok(b),
            None => Aligned::new(BLOCK),
        }
    }
}

impl Drop for Aligned {
    fn drop(&mut self) {
        if self.layout.size() == BLOCK {
            if let Ok(mut free) = FREE_BLOCKS.lock() {
                if free.len() < KEEP_BLOCKS {
                    free.push(Aligned {
                        ptr: std::mem::replace(&mut self.ptr, std::ptr::null_mut()),
                        layout: self.layout,
                    });
                    return;
                }
            }
        }
        if !self.ptr.is_null() {
            // SAFETY: allocated by `alloc_zeroed` with this layout, freed once (a block moved
            // to the free list left a null pointer behind).
            unsafe { dealloc(self.ptr, self.layout) }
        }
    }
}

// SAFETY: the buffer is plain bytes owned by this value alone.
unsafe impl Send for Aligned {}

/// Open `path` with `options`, direct if the filesystem allows it; whether it is.
fn open(path: &Path, options: &std::fs::OpenOptions) -> io::Result<(File, bool)> {
    let mut direct = options.clone();
    direct.custom_flags(libc::O_DIRECT);
    match direct.open(path) {
        Ok(f) => Ok((f, true)),
        // tmpfs and some FUSE filesystems refuse O_DIRECT.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((options.open(path)?, false)),
        Err(e) => Err(e),
    }
}

/// A block for the I/O thread: the buffer, its bytes to write, the file offset.
type WriteJob = (Aligned, usize, u64);

/// The range a [`DirectWriter::region`] writes: its unaligned head and tail go through the page
/// cache (a second descriptor without `O_DIRECT`), so no aligned block reaches past the range
/// into bytes another writer owns; the blocks between them go direct.
#[derive(Debug)]
struct Region {
    buffered: File,
    /// The range's first byte and its length.
    at: u64,
    len: u64,
    /// The bytes up to the first page boundary (all of them in a short range), staged.
    head: Vec<u8>,
    head_len: usize,
    /// The page boundary the head and tail end at ([`page_boundary`]).
    boundary: usize,
}

/// The larger of the direct-I/O alignment and the page size: a multiple of both (powers of
/// two), and a divisor of [`BLOCK`].
fn page_boundary() -> usize {
    // SAFETY: sysconf has no preconditions; a failure returns -1, handled below.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = usize::try_from(page).unwrap_or(ALIGN);
    match page.is_power_of_two() && page <= BLOCK {
        true => page.max(ALIGN),
        false => ALIGN,
    }
}

/// A new file written front to back, with `O_DIRECT` where the filesystem takes it; an I/O
/// thread writes one block while the caller fills the next. Or ([`DirectWriter::region`]) one
/// byte range of an existing file, which other writers (other processes) fill around it.
#[derive(Debug)]
pub struct DirectWriter {
    file: Arc<File>,
    direct: bool,
    /// The file offset of the first block.
    start: u64,
    /// Writing a range of an existing file, not a whole new one.
    region: Option<Region>,
    /// The block being filled (none once an I/O error ended the thread).
    cur: Option<Aligned>,
    /// Bytes staged in `cur`.
    fill: usize,
    /// Bytes handed to the I/O thread: the next block's offset.
    queued: u64,
    to_io: Option<SyncSender<WriteJob>>,
    /// Blocks the I/O thread has written, to fill again.
    free: Receiver<Aligned>,
    io: Option<JoinHandle<io::Result<()>>>,
}

impl DirectWriter {
    /// Create `path` (truncating it), direct if the filesystem allows it.
    pub fn create(path: &Path) -> io::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(true);
        let (file, direct) = open(path, &o)?;
        Self::start(file, direct, 0, None)
    }

    /// Write the `len` bytes of the existing file `path` at offset `at`, and nothing else:
    /// the writers of the other ranges (other processes, other hosts on a shared filesystem)
    /// fill the rest. The caller writes exactly `len` bytes; [`DirectWriter::finish`] makes
    /// them durable and leaves the file's length as it was.
    pub fn region(path: &Path, at: u64, len: u64) -> io::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.write(true);
        let (file, direct) = open(path, &o)?;
        let buffered = o.open(path)?;
        // The head and tail end at page boundaries, not only at the alignment: bytes written
        // through the page cache never share a page with this range's direct blocks (64 KiB
        // pages on some aarch64 kernels), where the direct write's invalidation and a
        // neighbour's partial-page write could race.
        let boundary = page_boundary() as u64;
        let head_len = match direct {
            true => ((boundary - at % boundary) % boundary).min(len) as usize,
            false => 0,
        };
        let region = Region {
            buffered,
            at,
            len,
            head: Vec::with_capacity(head_len),
            head_len,
            boundary: boundary as usize,
        };
        Self::start(file, direct, at + head_len as u64, Some(region))
    }

    fn start(file: File, direct: bool, start: u64, region: Option<Region>) -> io::Result<Self> {
        let file = Arc::new(file);
        let (to_io, jobs) = sync_channel::<WriteJob>(1);
        let (done, free) = sync_channel::<Aligned>(2);
        // The spare block: the thread hands each back once written.
        done.send(Aligned::block()?)
            .map_err(|_| io::Error::other("direct writer: channel closed"))?;
        let f = file.clone();
        let io = std::thread::Builder::new()
            .name("direct-write".into())
            .spawn(move || -> io::Result<()> {
                for (buf, len, offset) in jobs {
                    f.write_all_at(&buf.as_slice()[..len], offset)?;
                    if done.send(buf).is_err() {
                        break; // the writer is gone
                    }
                }
                Ok(())
            })?;
        Ok(DirectWriter {
            file,
            direct,
            start,
            region,
            cur: Some(Aligned::block()?),
            fill: 0,
            queued: 0,
            to_io: Some(to_io),
            free,
            io: Some(io),
        })
    }

    /// Whether writes bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The I/O thread's error, once it has stopped (or why it stopped without one).
    fn io_error(&mut self) -> io::Error {
        self.to_io = None;
        match self.io.take().map(JoinHandle::join) {
            Some(Ok(Err(e))) => e,
            Some(Err(_)) => io::Error::other("direct writer: the I/O thread panicked"),
            _ => io::Error::other("direct writer: the I/O thread stopped"),
        }
    }

    /// Hand the staged block to the I/O thread (padded to the alignment when `last`: the file
    /// is cut to its length by [`DirectWriter::finish`]) and take a free one.
    fn submit(&mut self, last: bool) -> io::Result<()> {
        let Some(mut buf) = self.cur.take() else {
            return Err(self.io_error());
        };
        let len = match (last, &self.region) {
            (false, _) => self.fill,
            // A range's last bytes past the last aligned offset go through the page cache.
            (true, Some(r)) => {
                let direct = match self.direct {
                    true => self.fill / r.boundary * r.boundary,
                    false => self.fill,
                };
                let tail = &buf.as_slice()[direct..self.fill];
                r.buffered
                    .write_all_at(tail, self.start + self.queued + direct as u64)?;
                direct
            }
            (true, None) => self.fill.div_ceil(ALIGN) * ALIGN,
        };
        buf.as_mut_slice()[self.fill.min(len)..len].fill(0);
        let sent = self
            .to_io
            .as_ref()
            .is_some_and(|t| t.send((buf, len, self.start + self.queued)).is_ok());
        if !sent {
            return Err(self.io_error());
        }
        self.queued += self.fill as u64;
        self.fill = 0;
        if !last {
            match self.free.recv() {
                Ok(b) => self.cur = Some(b),
                Err(_) => return Err(self.io_error()),
            }
        }
        Ok(())
    }

    /// Write what is staged, wait for every block, cut the file to the bytes written, make it
    /// durable; the file.
    pub fn finish(mut self) -> io::Result<File> {
        if let Some(r) = &self.region {
            let written = r.head.len() as u64 + self.queued + self.fill as u64;
            if written != r.len {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("a range of {} bytes was given {written}", r.len),
                ));
            }
            if r.head.len() < r.head_len {
                // A range shorter than its head: all of it staged there.
                r.buffered.write_all_at(&r.head, r.at)?;
            }
        }
        if self.fill > 0 {
            self.submit(true)?;
        }
        self.to_io = None;
        match self.io.take().map(JoinHandle::join) {
            Some(Ok(r)) => r?,
            Some(Err(_)) => return Err(io::Error::other("direct writer: the I/O thread panicked")),
            None => return Err(io::Error::other("direct writer: the I/O thread stopped")),
        }
        if self.region.is_none() {
            self.file.set_len(self.queued)?;
        }
        // Every dirty page of the file, the range's head and tail in the page cache included.
        self.file.sync_all()?;
        let file = Arc::clone(&self.file);
        drop(self); // its thread is joined: `file` is the last handle
        Arc::try_unwrap(file).map_err(|_| io::Error::other("direct writer: file still shared"))
    }
}

impl Write for DirectWriter {
    fn write(&mut self, mut data: &[u8]) -> io::Result<usize> {
        let n = data.len();
        if let Some(r) = self.region.as_mut() {
            if r.head.len() < r.head_len {
                let take = (r.head_len - r.head.len()).min(data.len());
                r.head.extend_from_slice(&data[..take]);
                data = &data[take..];
                if r.head.len() == r.head_len {
                    r.buffered.write_all_at(&r.head, r.at)?;
                }
            }
            let written = r.head.len() as u64 + self.queued + (self.fill + data.len()) as u64;
            if written > r.len {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("a range of {} bytes was given {written}", r.len),
                ));
            }
        }
        while !data.is_empty() {
            let Some(buf) = self.cur.as_mut() else {
                return Err(self.io_error());
            };
            let take = (BLOCK - self.fill).min(data.len());
            buf.as_mut_slice()[self.fill..self.fill + take].copy_from_slice(&data[..take]);
            self.fill += take;
            data = &data[take..];
            if self.fill == BLOCK {
                self.submit(false)?;
            }
        }
        Ok(n)
    }

    /// Staged bytes stay staged until a whole block can be written (or [`DirectWriter::finish`]).
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for DirectWriter {
    fn drop(&mut self) {
        // Unfinished (an error on the caller's side): stop the thread, wait for its block.
        self.to_io = None;
        if let Some(io) = self.io.take() {
            let _ = io.join();
        }
    }
}

/// A block the I/O thread read: the buffer and its bytes (fewer than a block at the end).
type ReadBlock = io::Result<(Aligned, usize)>;

/// A file read front to back, with `O_DIRECT` where the filesystem takes it; an I/O thread reads
/// the next block while the caller consumes one.
#[derive(Debug)]
pub struct DirectReader {
    /// Blocks read, in order.
    blocks: Option<Receiver<ReadBlock>>,
    /// Blocks consumed, for the thread to fill again.
    recycle: Option<SyncSender<Aligned>>,
    /// The block being consumed, its length and the position in it.
    cur: Option<(Aligned, usize, usize)>,
    /// Bytes of the first block before the range ([`DirectReader::range`]), not returned.
    skip: usize,
    /// Bytes left to return (the range's length; unbounded for a whole file).
    left: u64,
    io: Option<JoinHandle<()>>,
}

impl DirectReader {
    /// Open `path`, direct if the filesystem allows it.
    pub fn open(path: &Path) -> io::Result<Self> {
        Self::start(path, 0, 0, u64::MAX)
    }

    /// Read the `len` bytes of `path` at offset `at` (a unit's bytes in a checkpoint file that
    /// other ranks read the rest of): the aligned blocks around the range are read, no more.
    pub fn range(path: &Path, at: u64, len: u64) -> io::Result<Self> {
        let first = at / ALIGN as u64 * ALIGN as u64;
        let skip = (at - first) as usize;
        let stop = first + (skip as u64 + len).div_ceil(ALIGN as u64) * ALIGN as u64;
        let mut r = Self::start(path, first, skip, stop)?;
        r.left = len;
        Ok(r)
    }

    /// Read from the aligned offset `first` up to `stop`, the first `skip` bytes dropped.
    fn start(path: &Path, first: u64, skip: usize, stop: u64) -> io::Result<Self> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true);
        let (file, _) = open(path, &o)?;
        let (filled, blocks) = sync_channel::<ReadBlock>(READ_AHEAD);
        let (recycle, free) = sync_channel::<Aligned>(READ_AHEAD);
        for _ in 0..READ_AHEAD {
            recycle
                .send(Aligned::block()?)
                .map_err(|_| io::Error::other("direct reader: channel closed"))?;
        }
        let io = std::thread::Builder::new()
            .name("direct-read".into())
            .spawn(move || {
                let mut offset = first;
                for mut buf in free {
                    let want = (stop - offset).min(BLOCK as u64) as usize;
                    let mut got = 0;
                    let r = loop {
                        // A direct read continues only at aligned offsets: a short read that is
                        // not a whole number of blocks is the end of the file.
                        if got == want || got % ALIGN != 0 {
                            break Ok(got);
                        }
                        match file.read_at(&mut buf.as_mut_slice()[got..want], offset + got as u64)
                        {
                            Ok(0) => break Ok(got),
                            Ok(n) => got += n,
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => break Err(e),
                        }
                    };
                    let end = !matches!(r, Ok(n) if n == BLOCK) || offset + BLOCK as u64 >= stop;
                    if filled.send(r.map(|n| (buf, n))).is_err() || end {
                        break;
                    }
                    offset += BLOCK as u64;
                }
            })?;
        Ok(DirectReader {
            blocks: Some(blocks),
            recycle: Some(recycle),
            cur: None,
            skip,
            left: u64::MAX,
            io: Some(io),
        })
    }
}

impl Read for DirectReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        loop {
            if self.left == 0 {
                return Ok(0);
            }
            if let Some((buf, len, pos)) = self.cur.as_mut() {
                if *pos < *len {
                    let n = (*len - *pos).min(out.len()).min(self.left as usize);
                    out[..n].copy_from_slice(&buf.as_slice()[*pos..*pos + n]);
                    *pos += n;
                    self.left -= n as u64;
                    return Ok(n);
                }
                let (buf, len, _) = self.cur.take().unwrap_or_else(|| unreachable!());
                if len < BLOCK {
                    return Ok(0); // the last block is consumed
                }
                if let Some(r) = &self.recycle {
                    let _ = r.send(buf);
                }
            }
            match self.blocks.as_ref().map(Receiver::recv) {
                Some(Ok(Ok((buf, len)))) => {
                    let pos = self.skip.min(len);
                    self.skip -= pos;
                    self.cur = Some((buf, len, pos));
                }
                Some(Ok(Err(e))) => return Err(e),
                // The thread ended after the last block.
                Some(Err(_)) | None => return Ok(0),
            }
        }
    }
}

impl Drop for DirectReader {
    fn drop(&mut self) {
        // Closing both channels ends the thread wherever it is.
        self.recycle = None;
        self.blocks = None;
        if let Some(io) = self.io.take() {
            let _ = io.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_sizes_land_as_written() {
        let d = tempfile::tempdir().unwrap();
        for (k, sizes) in [
            vec![0usize],
            vec![1],
            vec![4095, 1, 4097],
            vec![BLOCK - 3, 7, BLOCK, 12_345],
            vec![3 * BLOCK + 17],
        ]
        .into_iter()
        .enumerate()
        {
            let path = d.path().join(format!("f{k}"));
            let mut w = DirectWriter::create(&path).unwrap();
            let mut want = Vec::new();
            for (i, &len) in sizes.iter().enumerate() {
                let part: Vec<u8> = (0..len).map(|j| (j * 31 + i * 7 + k) as u8).collect();
                w.write_all(&part).unwrap();
                want.extend(part);
            }
            w.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), want, "sizes {sizes:?}");
        }
    }

    /// Every byte comes back, whatever the size around the block and alignment boundaries, and
    /// whatever sizes the caller reads in.
    #[test]
    fn a_reader_returns_every_byte() {
        let d = tempfile::tempdir().unwrap();
        for (k, len) in [
            0usize,
            1,
            4096,
            4097,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            2 * BLOCK + 12_345,
        ]
        .into_iter()
        .enumerate()
        {
            let path = d.path().join(format!("r{k}"));
            let want: Vec<u8> = (0..len).map(|j| (j * 13 + k) as u8).collect();
            std::fs::write(&path, &want).unwrap();
            let mut r = DirectReader::open(&path).unwrap();
            let mut got = Vec::new();
            let mut piece = vec![0u8; 1_000_003];
            loop {
                let n = r.read(&mut piece).unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&piece[..n]);
            }
            assert_eq!(got.len(), len);
            assert!(got == want, "length {len}");
            // Dropped part-way, a reader stops its thread.
            let mut r = DirectReader::open(&path).unwrap();
            let _ = r.read(&mut piece[..10]).unwrap();
            drop(r);
        }
    }

    /// A range comes back byte for byte, whatever its offset and length around the alignment
    /// and block boundaries, and nothing past it; a range past the end of the file comes back
    /// short.
    #[test]
    fn a_range_reader_returns_the_range() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("f");
        let total = 2 * BLOCK + 9_999;
        let want: Vec<u8> = (0..total).map(|j| (j * 7 % 253) as u8).collect();
        std::fs::write(&path, &want).unwrap();
        for (at, len) in [
            (0usize, 0usize),
            (0, 1),
            (3, 4090),
            (4095, 2),
            (4096, 4096),
            (5, BLOCK),
            (BLOCK - 1, BLOCK + 2),
            (17, total - 17),
            (total - 1, 1),
        ] {
            let mut r = DirectReader::range(&path, at as u64, len as u64).unwrap();
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            assert!(got == want[at..at + len], "range {at}+{len}");
        }
        let mut r = DirectReader::range(&path, total as u64 - 3, 10).unwrap();
        let mut got = Vec::new();
        r.read_to_end(&mut got).unwrap();
        assert_eq!(got, want[total - 3..]);
    }

    /// A write the disk refuses (/dev/full: ENOSPC) is an error from `write` or `finish`, never
    /// lost in the I/O thread.
    #[test]
    fn a_failed_block_write_is_reported() {
        let mut w = DirectWriter::create(Path::new("/dev/full")).unwrap();
        let data = vec![7u8; BLOCK];
        let mut failed = false;
        for _ in 0..4 {
            if w.write_all(&data).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed || w.finish().is_err());
    }

    /// Ranges of one file written by writers at once (as the ranks of a job write a
    /// checkpoint's units), at offsets and lengths off the alignment and across blocks, short
    /// ranges inside one aligned block shared with their neighbours: the file holds every byte
    /// of each, and its length is left alone.
    #[test]
    fn ranges_written_at_once_fill_a_file() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("f");
        let lens = [
            5usize,
            4091,
            3,
            8192,
            BLOCK + 4100,
            17,
            2 * BLOCK - 1,
            1,
            0,
            9000,
        ];
        let total: usize = lens.iter().sum();
        std::fs::File::create(&path)
            .unwrap()
            .set_len(total as u64)
            .unwrap();
        let want: Vec<u8> = (0..total).map(|j| (j * 7 % 251) as u8 + 1).collect();
        let mut at = 0;
        let ranges: Vec<(usize, usize)> = lens
            .iter()
            .map(|&n| {
                at += n;
                (at - n, n)
            })
            .collect();
        std::thread::scope(|s| {
            for (k, &(at, n)) in ranges.iter().enumerate() {
                let (path, want) = (&path, &want);
                s.spawn(move || {
                    let mut w = DirectWriter::region(path, at as u64, n as u64).unwrap();
                    // In uneven pieces, as a unit's tensors arrive.
                    for piece in want[at..at + n].chunks(1000 + k * 777) {
                        w.write_all(piece).unwrap();
                    }
                    w.finish().unwrap();
                });
            }
        });
        let got = std::fs::read(&path).unwrap();
        assert_eq!(got.len(), total);
        assert!(got == want);
        // A range given more or fewer bytes than its length is refused.
        let mut w = DirectWriter::region(&path, 3, 10).unwrap();
        assert!(w.write_all(&[1u8; 11]).is_err());
        let mut w = DirectWriter::region(&path, 3, 10).unwrap();
        w.write_all(&[1u8; 9]).unwrap();
        assert!(w.finish().is_err());
    }

    /// A file that exists is replaced.
    #[test]
    fn an_existing_file_is_truncated() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("f");
        std::fs::write(&path, vec![9u8; 100_000]).unwrap();
        let mut w = DirectWriter::create(&path).unwrap();
        w.write_all(b"abc").unwrap();
        w.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abc");
    }
}
