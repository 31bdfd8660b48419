//! NUMA-bound host memory regions: anonymous mmap, bound to a node with `mbind` before first
//! touch, huge pages (transparent via madvise, or explicit hugetlbfs pages), prefaulted in
//! parallel by threads pinned to the node's CPUs, optionally locked, unmapped on drop.
//!
//! A region is raw memory. Who may read or write which byte is decided by its owner (the host
//! store hands out exclusive unit guards); the region only guarantees that the memory stays
//! mapped for as long as any `Arc<Region>` exists.

use crate::{Error, Result};
use std::ptr::NonNull;

/// Alignment of every shard inside a region: DMA engines and O_DIRECT want 4 KiB.
pub const SHARD_ALIGN: usize = 4096;

/// Which pages back a region.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum PageKind {
    /// 4 KiB pages, with `MADV_HUGEPAGE` so THP in `madvise` mode backs them with 2 MiB pages.
    #[default]
    #[value(name = "transparent")]
    #[serde(rename = "transparent")]
    Transparent,
    /// Explicit 2 MiB hugetlbfs pages (`vm.nr_hugepages`), which must be reserved beforehand.
    #[value(name = "2m")]
    #[serde(rename = "2m")]
    Huge2M,
    /// Explicit 1 GiB hugetlbfs pages.
    #[value(name = "1g")]
    #[serde(rename = "1g")]
    Huge1G,
    /// 4 KiB pages only (`MADV_NOHUGEPAGE`): what a plain `malloc` gives, for comparisons.
    #[value(name = "small")]
    #[serde(rename = "small")]
    Small,
}

impl PageKind {
    /// The page size in bytes.
    pub fn page_bytes(self) -> usize {
        match self {
            PageKind::Transparent | PageKind::Small => 4096,
            PageKind::Huge2M => 2 << 20,
            PageKind::Huge1G => 1 << 30,
        }
    }
}

/// How to allocate a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSpec {
    /// What the region holds, for error messages ("params of node 1", ...).
    pub label: String,
    /// Size in bytes (rounded up to the page size).
    pub bytes: usize,
    /// NUMA node (OS index) to bind to; `None` leaves the kernel's default policy.
    pub node: Option<u32>,
    /// CPUs (OS indices) that prefault the pages; empty = the calling thread only.
    pub prefault_cpus: Vec<usize>,
    /// Page kind.
    pub pages: PageKind,
    /// Lock the pages in RAM (`mlock`); needs `RLIMIT_MEMLOCK` ≥ `bytes` or CAP_IPC_LOCK.
    pub lock: bool,
}

impl RegionSpec {
    /// An unbound, unlocked region of `bytes` on transparent huge pages, prefaulted by the caller
    /// (I/O staging, benchmark buffers); change fields with struct update syntax.
    pub fn scratch(label: impl Into<String>, bytes: usize) -> Self {
        RegionSpec {
            label: label.into(),
            bytes,
            node: None,
            prefault_cpus: Vec::new(),
            pages: PageKind::Transparent,
            lock: false,
        }
    }
}

/// A registration of a region with a device (e.g. `cuMemHostRegister`), undone on drop.
pub trait Registration: Send + Sync + std::fmt::Debug {}

/// Something that can page-lock host memory for fast DMA (the CUDA device implements it).
pub trait HostRegistrar {
    /// Register `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the returned registration is dropped.
    unsafe fn register(&self, ptr: NonNull<u8>, len: usize) -> Result<Box<dyn Registration>>;

    /// The most bytes one [`HostRegistrar::register`] call should take: a region is registered
    /// in pieces of at most this ([`Region::register_pieces`]).
    fn max_piece(&self) -> usize {
        REGISTER_PIECE
    }
}

/// Bytes page-locked per registration call by default: a model store of a terabyte is
/// registered in dozens of calls, each failing (if it does) with its own size and place, rather
/// than in one call per region that a driver or IOMMU may refuse whole.
pub const REGISTER_PIECE: usize = 16 << 30;

/// How `len` bytes are registered in pieces of at most `max` bytes, cut only at `cuts` (offsets
/// no copy crosses: a copy from memory spanning two registrations is not a page-locked copy). A
/// stretch between two cuts longer than `max` stays one piece. Returns `(offset, len)` pieces
/// covering `0..len` in order.
pub fn pieces(len: usize, cuts: &[usize], max: usize) -> Vec<(usize, usize)> {
    let mut cuts: Vec<usize> = cuts.iter().copied().filter(|&c| c > 0 && c < len).collect();
    cuts.sort_unstable();
    cuts.dedup();
    cuts.push(len);
    let mut out = Vec::new();
    let (mut start, mut last) = (0usize, 0usize);
    for c in cuts {
        if c - start > max.max(1) && last > start {
            out.push((start, last - start));
            start = last;
        }
        last = c;
    }
    if len > start {
        out.push((start, len - start));
    }
    out
}

/// A registration made of pieces, undone together.
#[derive(Debug)]
struct Pieces(#[allow(dead_code)] Vec<Box<dyn Registration>>);

impl Registration for Pieces {}

/// `RLIMIT_MEMLOCK` as text.
fn memlock_limit() -> String {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return "unknown".into();
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        crate::util::human_bytes(r.rlim_cur)
    }
}

/// A mapped, NUMA-bound, prefaulted memory region.
#[derive(Debug)]
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    spec: RegionSpec,
    locked: bool,
    registration: Option<Box<dyn Registration>>,
}

// SAFETY: a Region is plain memory plus its bookkeeping; the raw pointer is owned by the region and
// valid until drop. Concurrent access discipline is the owner's (see module docs).
unsafe impl Send for Region {}
// SAFETY: as above; `&Region` only exposes the pointer and metadata.
unsafe impl Sync for Region {}

const MPOL_BIND: libc::c_int = 2;
/// mbind flag: fail if existing pages are not on the node (there are none yet: we bind first).
const MPOL_MF_STRICT: libc::c_uint = 1;

/// The kernel has no NUMA memory policy calls (ENOSYS): built without NUMA, or qemu-user.
fn without_numa(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSYS)
}

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

impl Region {
    /// Map, bind, prefault and (optionally) lock a region.
    pub fn allocate(spec: RegionSpec) -> Result<Region> {
        let page = spec.pages.page_bytes();
        let len = round_up(spec.bytes.max(1), page);
        if spec.lock {
            check_memlock(len, &spec.label)?;
        }
        if matches!(spec.pages, PageKind::Huge2M | PageKind::Huge1G) {
            check_huge_pages(spec.pages, len / page, spec.node, &spec.label)?;
        }
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        match spec.pages {
            PageKind::Transparent | PageKind::Small => {}
            PageKind::Huge2M => flags |= libc::MAP_HUGETLB | (21 << libc::MAP_HUGE_SHIFT),
            PageKind::Huge1G => flags |= libc::MAP_HUGETLB | (30 << libc::MAP_HUGE_SHIFT),
        }
        // SAFETY: anonymous mapping with no address hint; the kernel picks a fresh range.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            let fix = match spec.pages {
                PageKind::Transparent | PageKind::Small => {
                    "free memory or lower the RAM budget".to_owned()
                }
                k => format!(
                    "reserve {} huge pages of {} MiB (e.g. `sysctl vm.nr_hugepages=...` or /sys/devices/system/node/nodeN/hugepages) or use transparent huge pages",
                    len / k.page_bytes(),
                    k.page_bytes() >> 20
                ),
            };
            return Err(
                Error::system("mmap", format!("map {len} bytes for {}", spec.label), e)
                    .with_fix(fix),
            );
        }
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| Error::system("mmap", "map", "returned a null pointer"))?;
        // From here on, `region` unmaps on every error path.
        let mut region = Region {
            ptr,
            len,
            spec,
            locked: false,
            registration: None,
        };
        if region.spec.pages == PageKind::Transparent {
            // SAFETY: advising our own fresh mapping. Failure only means no THP (e.g. THP
            // disabled), which is not an error.
            unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
        }
        if region.spec.pages == PageKind::Small {
            // SAFETY: as above.
            unsafe { libc::madvise(raw, len, libc::MADV_NOHUGEPAGE) };
        }
        if let Some(node) = region.spec.node {
            region.bind(node)?;
        }
        region.prefault();
        if region.spec.lock {
            // SAFETY: locking our own mapping.
            if unsafe { libc::mlock(raw, len) } != 0 {
                let e = std::io::Error::last_os_error();
                return Err(Error::system(
                    "mlock",
                    format!("lock {} ({len} bytes)", region.spec.label),
                    e,
                )
                .with_fix("raise `ulimit -l` (memlock) or run with CAP_IPC_LOCK"));
            }
            region.locked = true;
        }
        Ok(region)
    }

    fn bind(&self, node: u32) -> Result<()> {
        let bits = usize::BITS as usize;
        let idx = node as usize;
        let mut mask = vec![0usize; idx / bits + 1];
        mask[idx / bits] |= 1 << (idx % bits);
        let maxnode = mask.len() * bits;
        // SAFETY: mbind on our own fresh mapping, with a nodemask buffer of `maxnode` bits.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                self.ptr.as_ptr(),
                self.len,
                MPOL_BIND,
                mask.as_ptr(),
                maxnode,
                MPOL_MF_STRICT,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if without_numa(&e) && node == 0 {
                // A kernel without NUMA (CONFIG_NUMA off, or qemu-user, which does not emulate
                // mbind) has one node, 0, that holds every page: the binding holds already.
                return Ok(());
            }
            return Err(Error::system(
                "mbind",
                format!("bind {} to NUMA node {node}", self.spec.label),
                e,
            )
            .with_fix(
                "check the node exists and is allowed (`megatrain probe`, cpuset/cgroup limits)",
            ));
        }
        Ok(())
    }

    /// Touch every page, from threads pinned to the node's CPUs, so the pages are placed now
    /// (by the binding) and no page fault lands in the training loop.
    fn prefault(&self) {
        let page = self.spec.pages.page_bytes();
        let cpus = &self.spec.prefault_cpus;
        let threads = cpus.len().max(1);
        let pages = self.len / page;
        let per = pages.div_ceil(threads);
        let base = self.ptr.as_ptr() as usize;
        std::thread::scope(|s| {
            for t in 0..threads {
                let first = t * per;
                let last = ((t + 1) * per).min(pages);
                if first >= last {
                    continue;
                }
                let cpu = cpus.get(t).copied();
                s.spawn(move || {
                    if let Some(cpu) = cpu {
                        // Best effort: placement is already decided by mbind.
                        let _ = crate::host::affinity::pin_current_thread(&[cpu]);
                    }
                    for p in first..last {
                        // SAFETY: p < pages, so the byte is inside our mapping; each thread
                        // writes a disjoint set of pages, and nothing else sees the region yet.
                        unsafe { std::ptr::write_volatile((base + p * page) as *mut u8, 0) };
                    }
                });
            }
        });
    }

    /// Start of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Mapped length in bytes (a multiple of the page size).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: regions have at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How the region was requested.
    pub fn spec(&self) -> &RegionSpec {
        &self.spec
    }

    /// Whether the pages are locked.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Page-lock the whole region with a device (e.g. CUDA's `cuMemHostRegister`) in one
    /// registration (a copy may span all of it; [`Region::register_pieces`] splits a region whose
    /// copies are per shard).
    pub fn register_with(&mut self, registrar: &dyn HostRegistrar) -> Result<()> {
        self.register_pieces(registrar, &[])
    }

    /// Page-lock the region in pieces ([`pieces`]) cut only at `cuts`, the offsets where copies
    /// start (a shard's start): no copy spans two registrations. A piece the device refuses is
    /// an error naming its bytes, its place, what was locked before it and the memlock limit;
    /// the pieces locked before it are released.
    pub fn register_pieces(&mut self, registrar: &dyn HostRegistrar, cuts: &[usize]) -> Result<()> {
        let plan = pieces(self.len, cuts, registrar.max_piece());
        let mut regs = Vec::with_capacity(plan.len());
        let mut done = 0usize;
        for (i, &(off, len)) in plan.iter().enumerate() {
            let Some(ptr) = NonNull::new(self.ptr.as_ptr().wrapping_add(off)) else {
                return Err(Error::internal("host region", "a null piece"));
            };
            // SAFETY: `off + len ≤ self.len` (the pieces cover the region); the registration is
            // stored in `self` and dropped before the munmap in Drop.
            match unsafe { registrar.register(ptr, len) } {
                Ok(r) => regs.push(r),
                Err(e) => {
                    return Err(Error::system(
                        "page lock",
                        format!(
                            "page-lock piece {} of {} ({} at offset {}) of the {} region ({})",
                            i + 1,
                            plan.len(),
                            crate::util::human_bytes(len as u64),
                            crate::util::human_bytes(off as u64),
                            self.spec.label,
                            crate::util::human_bytes(self.len as u64)
                        ),
                        format!(
                            "{e}; {} were page-locked before it; the memlock limit (ulimit -l) is {}",
                            crate::util::human_bytes(done as u64),
                            memlock_limit()
                        ),
                    )
                    .with_fix(
                        "raise the memlock limit (`ulimit -l unlimited`, LimitMEMLOCK=infinity for a service), free host memory, or lower --ram-budget so less is page-locked",
                    ));
                }
            }
            done += len;
        }
        self.registration = Some(Box::new(Pieces(regs)));
        Ok(())
    }

    /// Whether a device registration is held.
    pub fn is_registered(&self) -> bool {
        self.registration.is_some()
    }

    /// The NUMA node that holds the page at `offset`, from `get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR)`.
    pub fn node_of(&self, offset: usize) -> Result<u32> {
        if offset >= self.len {
            return Err(Error::bad_input(
                "region offset",
                offset.to_string(),
                "past the end of the region",
                None,
            ));
        }
        const MPOL_F_NODE: libc::c_ulong = 1;
        const MPOL_F_ADDR: libc::c_ulong = 2;
        let mut node: libc::c_int = -1;
        // SAFETY: get_mempolicy writes one int; the address is inside our mapping.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_get_mempolicy,
                &mut node as *mut libc::c_int,
                std::ptr::null_mut::<libc::c_ulong>(),
                0usize,
                self.ptr.as_ptr().add(offset),
                MPOL_F_NODE | MPOL_F_ADDR,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if without_numa(&e) {
                // One node, 0, holds every page (see `bind`).
                return Ok(0);
            }
            return Err(Error::system("get_mempolicy", "query page node", e));
        }
        u32::try_from(node)
            .map_err(|_| Error::system("get_mempolicy", "query page node", "negative node"))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Unregister before unmapping.
        self.registration = None;
        // SAFETY: unmapping exactly the mapping we created; no references into it outlive `self`
        // (borrows of the memory are tied to `&self`, and Arc owners keep `self` alive).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Fail early, with the fix, if fewer than `pages` explicit huge pages of `kind` are free (on
/// `node` when given, else machine-wide).
pub fn check_huge_pages(kind: PageKind, pages: usize, node: Option<u32>, what: &str) -> Result<()> {
    let kib = kind.page_bytes() / 1024;
    let dir = match node {
        Some(n) => format!("/sys/devices/system/node/node{n}/hugepages/hugepages-{kib}kB"),
        None => format!("/sys/kernel/mm/hugepages/hugepages-{kib}kB"),
    };
    let free: usize = std::fs::read_to_string(format!("{dir}/free_hugepages"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if free < pages {
        let place = node.map_or("the machine".to_owned(), |n| format!("NUMA node {n}"));
        return Err(Error::bad_input(
            "huge pages",
            what,
            format!("need {pages} free {} MiB pages on {place}, {free} are free", kind.page_bytes() >> 20),
            Some(&format!(
                "reserve them: `echo {} > {dir}/nr_hugepages` (as root), or use transparent huge pages",
                pages.max(1)
            )),
        ));
    }
    Ok(())
}

/// Fail early, with the fix, if `bytes` cannot be locked under `RLIMIT_MEMLOCK`.
pub fn check_memlock(bytes: usize, what: &str) -> Result<()> {
    let Some(lim) = crate::topology::linux::memlock() else {
        return Ok(());
    };
    // CAP_IPC_LOCK bypasses the limit; root usually has it.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(());
    }
    match lim.soft_bytes {
        Some(soft) if (bytes as u64) > soft => Err(Error::bad_input(
            "memory lock",
            what,
            format!(
                "memlock limit is {}, need {}",
                crate::util::human_bytes(soft),
                crate::util::human_bytes(bytes as u64)
            ),
            Some("raise `ulimit -l` (e.g. `ulimit -l unlimited`, or memlock in /etc/security/limits.conf) or run with CAP_IPC_LOCK"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(bytes: usize, node: Option<u32>) -> RegionSpec {
        RegionSpec {
            label: "test".into(),
            bytes,
            node,
            prefault_cpus: vec![0, 1],
            pages: PageKind::Transparent,
            lock: false,
        }
    }

    #[test]
    fn allocates_binds_and_reports_node() {
        let r = Region::allocate(spec(3 * 4096 + 5, Some(0))).unwrap();
        assert_eq!(r.len(), 4 * 4096);
        assert_eq!(r.as_ptr() as usize % 4096, 0);
        for off in [0, 4096, 3 * 4096 + 100] {
            assert_eq!(r.node_of(off).unwrap(), 0);
        }
        assert!(r.node_of(r.len()).is_err());
    }

    #[test]
    fn explicit_huge_pages_are_checked_up_front() {
        let free_2m: usize = std::fs::read_to_string(
            "/sys/devices/system/node/node0/hugepages/hugepages-2048kB/free_hugepages",
        )
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
        let want = free_2m + 1;
        let mut sp = spec(want * (2 << 20), Some(0));
        sp.pages = PageKind::Huge2M;
        let msg = Region::allocate(sp).unwrap_err().to_string();
        assert!(
            msg.contains("nr_hugepages") && msg.contains("NUMA node 0"),
            "{msg}"
        );
    }

    /// A registrar that records what it was given (the CUDA one cannot run on this machine).
    #[derive(Debug, Default)]
    struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<(usize, usize, bool)>>>);
    #[derive(Debug)]
    struct Rec(
        std::sync::Arc<std::sync::Mutex<Vec<(usize, usize, bool)>>>,
        usize,
    );
    impl Registration for Rec {}
    impl Drop for Rec {
        fn drop(&mut self) {
            self.0.lock().unwrap()[self.1].2 = false;
        }
    }
    impl HostRegistrar for Recorder {
        unsafe fn register(&self, ptr: NonNull<u8>, len: usize) -> Result<Box<dyn Registration>> {
            let mut v = self.0.lock().unwrap();
            v.push((ptr.as_ptr() as usize, len, true));
            Ok(Box::new(Rec(self.0.clone(), v.len() - 1)))
        }
    }

    #[test]
    fn registration_covers_the_region_and_ends_before_unmap() {
        let rec = Recorder::default();
        let mut r = Region::allocate(spec(10_000, Some(0))).unwrap();
        r.register_with(&rec).unwrap();
        assert!(r.is_registered());
        let (ptr, len) = (r.as_ptr() as usize, r.len());
        assert_eq!(rec.0.lock().unwrap()[0], (ptr, len, true));
        drop(r);
        assert!(!rec.0.lock().unwrap()[0].2, "registration released on drop");
    }

    #[test]
    fn pieces_cover_the_region_cut_only_where_allowed() {
        // Shards of 3, 5, 2, 9 and 1 bytes; pieces of at most 8.
        let cuts = [0, 3, 8, 10, 19];
        let p = pieces(20, &cuts, 8);
        assert_eq!(p, vec![(0, 8), (8, 2), (10, 9), (19, 1)]);
        // Everything fits one piece; no cuts at all; an empty region.
        assert_eq!(pieces(20, &cuts, 1 << 20), vec![(0, 20)]);
        assert_eq!(pieces(20, &[], 4), vec![(0, 20)]);
        assert_eq!(pieces(0, &[], 4), vec![]);
        // Random cuts: contiguous cover, cut only at cuts, and no two neighbouring pieces that
        // would have fitted one.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = 1 + (x % 1000) as usize;
            let max = 1 + (x >> 20) as usize % 200;
            let cuts: Vec<usize> = (0..(x >> 40) % 30)
                .map(|i| ((x >> i) as usize).wrapping_mul(7919) % len)
                .collect();
            let p = pieces(len, &cuts, max);
            let mut at = 0;
            for (i, &(o, l)) in p.iter().enumerate() {
                assert_eq!(o, at);
                assert!(l > 0);
                assert!(o == 0 || cuts.contains(&o), "{o} is not a cut");
                if i + 1 < p.len() {
                    assert!(l + p[i + 1].1 > max, "{p:?} could merge at {i}");
                }
                at += l;
            }
            assert_eq!(at, len);
        }
    }

    #[test]
    fn a_refused_piece_names_itself_and_releases_the_others() {
        #[derive(Debug)]
        struct RefuseSecond(Recorder, std::sync::atomic::AtomicUsize);
        impl HostRegistrar for RefuseSecond {
            unsafe fn register(
                &self,
                ptr: NonNull<u8>,
                len: usize,
            ) -> Result<Box<dyn Registration>> {
                if self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                    return Err(Error::system(
                        "CUDA driver",
                        "cuMemHostRegister",
                        "out of memory",
                    ));
                }
                // SAFETY: forwarded.
                unsafe { self.0.register(ptr, len) }
            }
            fn max_piece(&self) -> usize {
                4096
            }
        }
        let rec = RefuseSecond(Recorder::default(), 0.into());
        let mut r = Region::allocate(spec(3 * 4096, Some(0))).unwrap();
        let e = r
            .register_pieces(&rec, &[4096, 8192])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("piece 2 of 3 (4.0 KiB at offset 4.0 KiB)"),
            "{e}"
        );
        assert!(e.contains("4.0 KiB were page-locked before it"), "{e}");
        assert!(e.contains("ulimit -l"), "{e}");
        assert!(!r.is_registered());
        let log = rec.0 .0.lock().unwrap();
        assert_eq!(log.len(), 1);
        assert!(!log[0].2, "the first piece was released");
    }

    #[test]
    fn locked_region_is_locked() {
        let mut sp = spec(64 * 1024, Some(0));
        sp.lock = true;
        match Region::allocate(sp) {
            Ok(r) => assert!(r.is_locked()),
            // Unprivileged with a small memlock limit: the error must name the fix.
            Err(e) => assert!(e.to_string().contains("ulimit -l"), "{e}"),
        }
    }

    #[test]
    fn binding_to_a_missing_node_is_a_clear_error() {
        let e = Region::allocate(spec(4096, Some(1000))).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("NUMA node 1000"), "{msg}");
    }
}
