//! Device memory and the host memory the device may touch.
//!
//! Each `cuMemAlloc` is its own mapping: a PROT_NONE guard page, the data pages, a PROT_NONE
//! guard page. The allocation ends 256-byte aligned at most 255 bytes before the trailing
//! guard (CUDA's alignment); the slack on both sides holds a canary checked after every command
//! that may have written the allocation, so an overrun is caught even inside the slack, and
//! one beyond it faults on the guard page. New memory holds the poison byte 0xFF (a NaN as f32,
//! bf16 and f64, -1 as an integer), so a read of memory nothing wrote shows up — a copy to the
//! host of never-written words is reported. Freed memory is poisoned, made PROT_NONE and kept
//! for a while, so a use after free faults and is named as one.
//!
//! Host memory registered with `cuMemHostRegister` or allocated with `cuMemHostAlloc` is
//! tracked: an asynchronous copy is asynchronous only from there, and unregistering or freeing
//! it while a queued copy still uses it is an error.

use crate::clock::AccessLog;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

pub const POISON: u8 = 0xFF;
const CANARY: u8 = 0xCB;
const ALIGN: usize = 256;
/// Freed mappings kept PROT_NONE to name a use after free (oldest unmapped first).
const QUARANTINE: usize = 4096;

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

#[derive(Debug)]
pub struct Alloc {
    pub id: u64,
    pub base: u64,
    pub size: usize,
    map: usize,
    map_len: usize,
    data_start: usize,
    data_end: usize,
    pub log: AccessLog,
    /// The last command that wrote it (for reports).
    pub last_writer: Option<Arc<str>>,
    /// Commands enqueued and not yet completed that use it.
    pub pending: u64,
    /// A `cuMemFreeAsync` of it is queued: any later use is a use after free.
    pub freeing: bool,
}

impl Alloc {
    pub fn name(&self) -> String {
        format!(
            "allocation #{} (0x{:x}, {} bytes)",
            self.id, self.base, self.size
        )
    }

    pub fn end(&self) -> u64 {
        self.base + self.size as u64
    }

    /// The first damaged canary byte: `(offset from base, bytes damaged)`.
    pub fn damaged_canary(&self) -> Option<(i64, usize)> {
        let base = self.base as usize;
        // SAFETY: [data_start, data_end) is mapped read/write for the allocation's life.
        let head = unsafe {
            std::slice::from_raw_parts(self.data_start as *const u8, base - self.data_start)
        };
        // SAFETY: as above.
        let tail = unsafe {
            std::slice::from_raw_parts(
                (base + self.size) as *const u8,
                self.data_end - base - self.size,
            )
        };
        if let Some(i) = tail.iter().position(|&b| b != CANARY) {
            let n = tail.iter().filter(|&&b| b != CANARY).count();
            return Some((self.size as i64 + i as i64, n));
        }
        if let Some(i) = head.iter().rposition(|&b| b != CANARY) {
            let n = head.iter().filter(|&&b| b != CANARY).count();
            return Some((i as i64 - head.len() as i64, n));
        }
        None
    }

    /// Repair the canary (after reporting it), so one overrun is reported once.
    pub fn reset_canary(&self) {
        let base = self.base as usize;
        // SAFETY: the slack ranges are inside the mapping.
        unsafe {
            std::ptr::write_bytes(self.data_start as *mut u8, CANARY, base - self.data_start);
            std::ptr::write_bytes(
                (base + self.size) as *mut u8,
                CANARY,
                self.data_end - base - self.size,
            );
        }
    }
}

#[derive(Debug)]
struct Freed {
    id: u64,
    base: u64,
    size: usize,
    map: usize,
    map_len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKind {
    /// `cuMemHostRegister`.
    Registered,
    /// `cuMemHostAlloc` / `cuMemAllocHost` (the mapping is ours).
    Pinned { map: usize, map_len: usize },
}

#[derive(Debug)]
pub struct HostRange {
    pub base: usize,
    pub len: usize,
    pub kind: HostKind,
    /// Queued copies that use it.
    pub pending: u64,
}

#[derive(Debug, Default)]
pub struct Memory {
    allocs: BTreeMap<u64, Alloc>,
    freed: VecDeque<Freed>,
    host: BTreeMap<usize, HostRange>,
    pub used: u64,
    next_id: u64,
}

pub fn mem() -> MutexGuard<'static, Memory> {
    static M: OnceLock<Mutex<Memory>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(Memory::default()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// What went wrong with a device allocation request.
pub enum AllocError {
    OutOfMemory,
    Map,
}

impl Memory {
    /// A new poisoned allocation of `size` bytes, within `capacity` in all.
    pub fn alloc(&mut self, size: usize, capacity: u64) -> Result<u64, AllocError> {
        if self.used.saturating_add(size as u64) > capacity {
            return Err(AllocError::OutOfMemory);
        }
        let pg = page();
        let data = (size.div_ceil(ALIGN) * ALIGN).div_ceil(pg) * pg;
        let map_len = data + 2 * pg;
        // SAFETY: an anonymous private mapping; checked for failure below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(AllocError::Map);
        }
        let map = map as usize;
        let (data_start, data_end) = (map + pg, map + pg + data);
        // SAFETY: the two guard pages are inside the new mapping.
        unsafe {
            libc::mprotect(map as *mut libc::c_void, pg, libc::PROT_NONE);
            libc::mprotect(data_end as *mut libc::c_void, pg, libc::PROT_NONE);
        }
        let base = data_end - size.div_ceil(ALIGN) * ALIGN;
        // SAFETY: [data_start, data_end) is mapped read/write.
        unsafe {
            std::ptr::write_bytes(data_start as *mut u8, CANARY, base - data_start);
            std::ptr::write_bytes(base as *mut u8, POISON, size);
            std::ptr::write_bytes((base + size) as *mut u8, CANARY, data_end - base - size);
        }
        self.next_id += 1;
        self.used += size as u64;
        self.allocs.insert(
            base as u64,
            Alloc {
                id: self.next_id,
                base: base as u64,
                size,
                map,
                map_len,
                data_start,
                data_end,
                log: AccessLog::default(),
                last_writer: None,
                pending: 0,
                freeing: false,
            },
        );
        Ok(base as u64)
    }

    /// Free the allocation starting at `ptr`: poisoned, made inaccessible, kept in quarantine.
    pub fn free(&mut self, ptr: u64) -> Option<Alloc> {
        let a = self.allocs.remove(&ptr)?;
        self.used -= a.size as u64;
        // SAFETY: the allocation's own mapping; nothing uses it any more (the caller checked
        // pending commands).
        unsafe {
            std::ptr::write_bytes(a.base as *mut u8, POISON, a.size);
            libc::madvise(a.map as *mut libc::c_void, a.map_len, libc::MADV_DONTNEED);
            libc::mprotect(a.map as *mut libc::c_void, a.map_len, libc::PROT_NONE);
        }
        self.freed.push_back(Freed {
            id: a.id,
            base: a.base,
            size: a.size,
            map: a.map,
            map_len: a.map_len,
        });
        while self.freed.len() > QUARANTINE {
            if let Some(f) = self.freed.pop_front() {
                // SAFETY: a quarantined mapping nothing refers to.
                unsafe { libc::munmap(f.map as *mut libc::c_void, f.map_len) };
            }
        }
        Some(a)
    }

    /// The live allocation holding `ptr`.
    pub fn find(&self, ptr: u64) -> Option<&Alloc> {
        self.allocs
            .range(..=ptr)
            .next_back()
            .map(|(_, a)| a)
            .filter(|a| ptr < a.end())
    }

    pub fn by_base_mut(&mut self, base: u64) -> Option<&mut Alloc> {
        self.allocs.get_mut(&base)
    }

    /// The live allocation holding all of `[ptr, ptr + len)`, or why not.
    pub fn range(&self, ptr: u64, len: usize) -> Result<&Alloc, String> {
        match self.find(ptr) {
            Some(a) if ptr + len as u64 <= a.end() => Ok(a),
            Some(a) => Err(format!(
                "{len} bytes at 0x{ptr:x} run {} bytes past the end of {}",
                ptr + len as u64 - a.end(),
                a.name()
            )),
            None => Err(format!("0x{ptr:x} is {}", self.describe(ptr))),
        }
    }

    /// Where `addr` is, in words: inside or beside an allocation, in a freed one, or nowhere.
    pub fn describe(&self, addr: u64) -> String {
        if let Some(a) = self.find(addr) {
            return format!("byte {} of {}", addr - a.base, a.name());
        }
        for a in self.allocs.values() {
            let (lo, hi) = (a.map as u64, (a.map + a.map_len) as u64);
            if (lo..hi).contains(&addr) {
                return if addr >= a.end() {
                    format!("{} bytes past the end of {}", addr - a.end(), a.name())
                } else {
                    format!("{} bytes before the start of {}", a.base - addr, a.name())
                };
            }
        }
        for f in self.freed.iter().rev() {
            if (f.map as u64..(f.map + f.map_len) as u64).contains(&addr) {
                return format!(
                    "inside allocation #{} (0x{:x}, {} bytes), already freed with cuMemFree (a use after free)",
                    f.id, f.base, f.size
                );
            }
        }
        if let Some(h) = self.host_containing(addr as usize, 1) {
            return format!(
                "host memory (a {} range of {} bytes at 0x{:x})",
                match h.kind {
                    HostKind::Registered => "registered",
                    HostKind::Pinned { .. } => "page-locked",
                },
                h.len,
                h.base
            );
        }
        "not in any device allocation".to_owned()
    }

    /// A freed allocation's description, if `addr` was in one.
    pub fn freed(&self, addr: u64) -> Option<String> {
        self.freed
            .iter()
            .rev()
            .find(|f| (f.base..f.base + f.size as u64).contains(&addr))
            .map(|f| format!("allocation #{} (0x{:x}, {} bytes)", f.id, f.base, f.size))
    }

    // ---- host memory ----------------------------------------------------------------------

    /// The registered or page-locked host range holding all of `[ptr, ptr + len)`.
    pub fn host_containing(&self, ptr: usize, len: usize) -> Option<&HostRange> {
        self.host
            .range(..=ptr)
            .next_back()
            .map(|(_, h)| h)
            .filter(|h| ptr + len <= h.base + h.len)
    }

    pub fn host_containing_mut(&mut self, ptr: usize, len: usize) -> Option<&mut HostRange> {
        self.host
            .range_mut(..=ptr)
            .next_back()
            .map(|(_, h)| h)
            .filter(|h| ptr + len <= h.base + h.len)
    }

    /// Whether `[ptr, ptr+len)` overlaps a tracked host range.
    pub fn host_overlaps(&self, ptr: usize, len: usize) -> bool {
        self.host
            .range(..ptr + len)
            .next_back()
            .is_some_and(|(_, h)| h.base + h.len > ptr)
    }

    pub fn add_host(&mut self, base: usize, len: usize, kind: HostKind) {
        self.host.insert(
            base,
            HostRange {
                base,
                len,
                kind,
                pending: 0,
            },
        );
    }

    pub fn host_at(&self, base: usize) -> Option<&HostRange> {
        self.host.get(&base)
    }

    pub fn remove_host(&mut self, base: usize) -> Option<HostRange> {
        self.host.remove(&base)
    }

    /// Page-locked host memory of `len` bytes (ours to map).
    pub fn alloc_pinned(&mut self, len: usize) -> Option<usize> {
        let map_len = len.max(1).div_ceil(page()) * page();
        // SAFETY: an anonymous private mapping; checked below.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if m == libc::MAP_FAILED {
            return None;
        }
        let base = m as usize;
        self.add_host(base, len, HostKind::Pinned { map: base, map_len });
        Some(base)
    }
}

/// Unmap page-locked memory the emulator allocated.
pub fn unmap_pinned(kind: HostKind) {
    if let HostKind::Pinned { map, map_len } = kind {
        // SAFETY: our own mapping, no longer tracked.
        unsafe { libc::munmap(map as *mut libc::c_void, map_len) };
    }
}

/// Whether `bytes` (a copy's source, read from device memory) holds a 4-byte word nothing wrote
/// since allocation: `Some(first offset, words)`.
pub fn poisoned_words(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut first = None;
    let mut n = 0;
    for (i, w) in bytes.chunks_exact(4).enumerate() {
        if w.iter().all(|&b| b == POISON) {
            n += 1;
            first.get_or_insert(i * 4);
        }
    }
    first.map(|f| (f, n))
}
