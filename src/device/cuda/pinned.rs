//! Page-locked host memory, as owning types: [`Pinned`] (memory the driver allocates,
//! `cuMemHostAlloc`) and [`PageLock`] (memory we own, page-locked in place with
//! `cuMemHostRegister` — portable, not write-combined — and unregistered on drop). No lock is
//! paired with an unlock by hand on an error path; the store registers its regions through
//! [`CudaRegistrar`]. Also [`host_fn`]: a closure run in stream order.

use super::runtime::drv;
use crate::host::region::Registration;
use crate::host::HostRegistrar;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream};
use std::ptr::NonNull;
use std::sync::Arc;

/// Page-locked host memory from `cuMemHostAlloc`, freed on drop.
#[derive(Debug)]
pub struct Pinned {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain memory owned by this value; users synchronize access through stream order.
unsafe impl Send for Pinned {}
// SAFETY: as above.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// `bytes` of page-locked memory (portable: usable from every context).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        drv(ctx.bind_to_thread(), "bind the context")?;
        // SAFETY: allocates; freed in Drop.
        let ptr = unsafe {
            cudarc::driver::result::malloc_host(
                bytes.max(4),
                cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(|e| {
            Error::cuda(
                format!(
                    "allocate {} of page-locked memory",
                    crate::util::human_bytes(bytes as u64)
                ),
                e,
            )
            .with_fix("raise the memlock limit (`ulimit -l unlimited`) or free host memory")
        })?;
        Ok(Pinned {
            ptr: ptr.cast(),
            bytes,
            ctx: ctx.clone(),
        })
    }

    /// `bytes` of page-locked memory the GPU can also address (`CU_MEMHOSTALLOC_DEVICEMAP`), and
    /// that address: what a stream reads a flag from (`cuStreamWaitValue32`).
    pub fn mapped(ctx: &Arc<CudaContext>, bytes: usize) -> Result<(Self, u64)> {
        drv(ctx.bind_to_thread(), "bind the context")?;
        use cudarc::driver::sys;
        // SAFETY: allocates; freed in Drop.
        let ptr = unsafe {
            cudarc::driver::result::malloc_host(
                bytes.max(4),
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .map_err(|e| Error::cuda("allocate device-mapped page-locked memory", e))?;
        let p = Pinned {
            ptr: ptr.cast(),
            bytes,
            ctx: ctx.clone(),
        };
        let mut dev = 0u64;
        // SAFETY: `p` is page-locked memory just allocated with DEVICEMAP; writes one address.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p.ptr.cast(), 0) };
        drv(r.result(), "map page-locked memory for the GPU")?;
        Ok((p, dev))
    }

    /// The memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its size.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // The dropping thread may not have the context current.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in `new`; owners synchronize before dropping.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

/// Host memory page-locked in place (`cuMemHostRegister`, portable) until dropped.
#[derive(Debug)]
pub struct PageLock {
    ptr: usize,
    ctx: Arc<CudaContext>,
}

impl PageLock {
    /// Page-lock `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped until the returned value is dropped.
    pub unsafe fn new(ctx: &Arc<CudaContext>, ptr: NonNull<u8>, len: usize) -> Result<Self> {
        drv(ctx.bind_to_thread(), "bind the context")?;
        // SAFETY: forwarded contract: the range stays mapped while registered.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                ptr.as_ptr().cast(),
                len,
                cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        r.result().map_err(|e| {
            Error::cuda(
                format!(
                    "page-lock {} with cuMemHostRegister",
                    crate::util::human_bytes(len as u64)
                ),
                e,
            )
            .with_fix(
                "raise the memlock limit (`ulimit -l unlimited`, LimitMEMLOCK=infinity for a service) or run with CAP_IPC_LOCK",
            )
        })?;
        Ok(PageLock {
            ptr: ptr.as_ptr() as usize,
            ctx: ctx.clone(),
        })
    }

    /// Page-lock a whole region (which must outlive the lock).
    pub fn region(ctx: &Arc<CudaContext>, region: &crate::host::Region) -> Result<Self> {
        let ptr = NonNull::new(region.as_ptr())
            .ok_or_else(|| Error::internal("page lock", "a region with a null base"))?;
        // SAFETY: the caller keeps the region mapped while the lock lives (it is dropped first
        // wherever both are owned together).
        unsafe { Self::new(ctx, ptr, region.len()) }
    }
}

impl Drop for PageLock {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered in `new`; the range is still mapped (the owner drops the lock
        // before unmapping).
        unsafe { cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut _) };
    }
}

impl Registration for PageLock {}

/// Page-locks host regions for the GPU: what the store hands its params and grads regions to.
#[derive(Debug)]
pub struct CudaRegistrar(pub Arc<CudaContext>);

impl HostRegistrar for CudaRegistrar {
    unsafe fn register(&self, ptr: NonNull<u8>, len: usize) -> Result<Box<dyn Registration>> {
        // SAFETY: the caller keeps `ptr..ptr+len` mapped until the registration drops.
        Ok(Box::new(unsafe { PageLock::new(&self.0, ptr, len)? }))
    }

    /// [`crate::host::region::REGISTER_PIECE`], or `MEGATRAIN_REGISTER_PIECE` bytes (smaller
    /// pieces for a driver that refuses large ones; the test suite uses it to cut at every
    /// shard).
    fn max_piece(&self) -> usize {
        std::env::var("MEGATRAIN_REGISTER_PIECE")
            .ok()
            .and_then(|v| crate::util::size::parse_size(&v).ok())
            .map_or(crate::host::region::REGISTER_PIECE, |b| b.max(1) as usize)
    }
}

unsafe extern "C" fn run_boxed(arg: *mut std::ffi::c_void) {
    // SAFETY: `arg` is the Box leaked by `host_fn`, run exactly once here.
    let f: Box<Box<dyn FnOnce() + Send>> = unsafe { Box::from_raw(arg.cast()) };
    // A panic must not unwind into the driver.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// Run `f` on a driver thread once everything enqueued on `stream` before it is done (it holds
/// the stream until it returns). `f` must not call CUDA (a host function that does is an error
/// in CUDA).
pub fn host_fn(stream: &CudaStream, f: impl FnOnce() + Send + 'static) -> Result<()> {
    let b: Box<Box<dyn FnOnce() + Send>> = Box::new(Box::new(f));
    let raw = Box::into_raw(b);
    // SAFETY: `run_boxed` takes ownership of `raw` when the driver calls it.
    let r = unsafe {
        cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            run_boxed,
            raw.cast(),
        )
    };
    if let Err(e) = r {
        // SAFETY: the driver refused it, so it will never run: reclaim the Box.
        drop(unsafe { Box::from_raw(raw) });
        return Err(Error::cuda("enqueue a host function", e));
    }
    Ok(())
}
