//! A unit's fp32 master parameters as the layout stores them: one fp32 array, or the bf16
//! planes of [`super::planes`] — read and written as fp32 either way.

use super::layout::{MasterFormat, ShardKind};
use super::{planes, HostStore};

/// A unit's fp32 master parameters, as the layout stores them ([`super::layout::MasterFormat`]).
#[derive(Debug)]
pub enum Master<'a> {
    /// One fp32 array.
    Fp32(&'a mut [f32]),
    /// The bf16-rounded high plane and the low plane ([`planes`]), element for element.
    Planes {
        /// High halves, rounded: the bf16 copy the device streams.
        hi: &'a mut [u16],
        /// Low halves.
        lo: &'a mut [u16],
    },
}

/// A read-only view of a unit's fp32 master: what device copies and checkpoint snapshots read
/// (several readers at once; see [`super::snapshot`]).
#[derive(Debug, Clone, Copy)]
pub enum MasterRef<'a> {
    /// One fp32 array.
    Fp32(&'a [f32]),
    /// The high and low planes.
    Planes {
        /// High halves (the bf16 copy).
        hi: &'a [u16],
        /// Low halves.
        lo: &'a [u16],
    },
}

impl MasterRef<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            MasterRef::Fp32(p) => p.len(),
            MasterRef::Planes { hi, .. } => hi.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + dst.len()` as fp32 into `dst`.
    pub fn read(&self, start: usize, dst: &mut [f32]) {
        let r = start..start + dst.len();
        match self {
            MasterRef::Fp32(p) => dst.copy_from_slice(&p[r]),
            MasterRef::Planes { hi, lo } => planes::join_into(&hi[r.clone()], &lo[r], dst),
        }
    }

    /// Every element as fp32.
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.len()];
        self.read(0, &mut v);
        v
    }
}

impl Master<'_> {
    /// The same memory, read-only.
    pub fn view(&self) -> MasterRef<'_> {
        match self {
            Master::Fp32(p) => MasterRef::Fp32(p),
            Master::Planes { hi, lo } => MasterRef::Planes { hi, lo },
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.view().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + dst.len()` as fp32 into `dst`.
    pub fn read(&self, start: usize, dst: &mut [f32]) {
        self.view().read(start, dst)
    }

    /// Every element as fp32.
    pub fn to_vec(&self) -> Vec<f32> {
        self.view().to_vec()
    }

    /// Set elements `start..start + src.len()` to `src`.
    pub fn write(&mut self, start: usize, src: &[f32]) {
        let r = start..start + src.len();
        match self {
            Master::Fp32(p) => p[r].copy_from_slice(src),
            Master::Planes { hi, lo } => {
                planes::split_into(src, &mut hi[r.clone()], &mut lo[r]);
            }
        }
    }

    /// The fp32 array, when the master is stored as one.
    pub fn as_fp32(&mut self) -> Option<&mut [f32]> {
        match self {
            Master::Fp32(p) => Some(p),
            Master::Planes { .. } => None,
        }
    }

    /// The bf16 high plane, when the master is stored as planes.
    pub fn hi_plane(&mut self) -> Option<&mut [u16]> {
        match self {
            Master::Fp32(_) => None,
            Master::Planes { hi, .. } => Some(hi),
        }
    }
}

impl HostStore {
    /// `unit`'s params read-only. The caller holds the unit's guard or its frozen snapshot
    /// entry: nobody writes them while the view lives.
    pub(super) fn master_ref(&self, unit: usize) -> MasterRef<'_> {
        let Some(p) = self.shard_ptr(unit, ShardKind::Params) else {
            return MasterRef::Fp32(&[]);
        };
        let n = self.inner.layout.units[unit].numel;
        match self.layout().master {
            MasterFormat::Fp32 => {
                // SAFETY: the params shard holds ≥ n f32s, is 4 KiB aligned and lives as long
                // as the store; writers (an update through `shards`/`master`) are excluded by
                // the caller's guard or snapshot, readers may share it.
                let p = unsafe { std::slice::from_raw_parts(p.cast::<f32>(), n) };
                MasterRef::Fp32(p)
            }
            MasterFormat::Planes => {
                let lo_at = self.layout().lo_plane_offset(unit);
                // SAFETY: as `master_at`: two planes of ≥ 2·n bytes each, in bounds and
                // aligned; shared as for fp32.
                unsafe {
                    MasterRef::Planes {
                        hi: std::slice::from_raw_parts(p.cast::<u16>(), n),
                        lo: std::slice::from_raw_parts(p.add(lo_at).cast::<u16>(), n),
                    }
                }
            }
        }
    }
}
