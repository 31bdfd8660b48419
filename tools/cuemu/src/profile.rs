//! The emulated GPU (`CUEMU_DEVICE=h100|h200|gh200|t4`): what the driver reports about it and the
//! limits a launch is checked against. Figures from NVIDIA's datasheets and the CUDA
//! programming guide's compute capability 9.0 and 7.5 tables. `t4` (sm_75) is there to be
//! refused: it checks that a program says which GPUs it needs.

#[derive(Debug, Clone)]
pub struct Profile {
    pub name: &'static str,
    pub cc: (i32, i32),
    pub sms: i32,
    pub memory: u64,
    /// The driver's CUDA version (`12090` = 12.9).
    pub driver: i32,
    pub pci: (i32, i32, i32),
    /// Shared memory per block without opt-in, and the opt-in maximum.
    pub smem_block: i32,
    pub smem_optin: i32,
    pub smem_sm: i32,
    pub l2: i32,
    pub clock_khz: i32,
    pub mem_clock_khz: i32,
    pub bus_width: i32,
}

impl Profile {
    pub fn by_name(name: &str) -> Profile {
        let h100 = Profile {
            name: "NVIDIA H100 80GB HBM3 (cuemu)",
            cc: (9, 0),
            sms: 132,
            memory: 80 << 30,
            driver: 12090,
            pci: (0, 0x18, 0),
            smem_block: 48 << 10,
            smem_optin: 227 << 10,
            smem_sm: 228 << 10,
            l2: 50 << 20,
            clock_khz: 1_980_000,
            mem_clock_khz: 2_619_000,
            bus_width: 5120,
        };
        match name {
            "h200" => Profile {
                name: "NVIDIA H200 (cuemu)",
                memory: 141 * 1000 * 1000 * 1000,
                mem_clock_khz: 3_201_000,
                bus_width: 6144,
                ..h100
            },
            "gh200" => Profile {
                name: "NVIDIA GH200 480GB (cuemu)",
                memory: 96 << 30,
                pci: (9, 1, 0),
                ..h100
            },
            "t4" => Profile {
                name: "Tesla T4 (cuemu)",
                cc: (7, 5),
                sms: 40,
                memory: 15 << 30,
                pci: (0, 0x3b, 0),
                smem_optin: 64 << 10,
                smem_sm: 64 << 10,
                l2: 4 << 20,
                clock_khz: 1_590_000,
                mem_clock_khz: 5_001_000,
                bus_width: 256,
                ..h100
            },
            _ => h100,
        }
    }

    /// The highest PTX ISA version this profile's driver can JIT (`(major, minor)`): CUDA 12.x
    /// drivers take ISA 8.x up to their release, 13.0 takes 9.0.
    pub fn max_ptx(driver: i32) -> (u32, u32) {
        match driver / 10 {
            d if d >= 1300 => (9, 0),
            1209 => (8, 8),
            1208 => (8, 7),
            1206 | 1207 => (8, 5),
            1205 => (8, 5),
            1204 => (8, 4),
            1203 => (8, 3),
            1202 => (8, 2),
            1201 => (8, 1),
            1200 => (8, 0),
            _ => (7, 8),
        }
    }

    /// `cuDeviceGetAttribute`: `None` for an attribute this profile does not model.
    pub fn attribute(&self, attr: i32, memory: u64) -> Option<i32> {
        let _ = memory;
        Some(match attr {
            1 => 1024,                                           // MAX_THREADS_PER_BLOCK
            2 | 3 => 1024,                                       // MAX_BLOCK_DIM_X/Y
            4 => 64,                                             // MAX_BLOCK_DIM_Z
            5 => i32::MAX,                                       // MAX_GRID_DIM_X
            6 | 7 => 65535,                                      // MAX_GRID_DIM_Y/Z
            8 => self.smem_block,                                // MAX_SHARED_MEMORY_PER_BLOCK
            9 => 64 << 10,                                       // TOTAL_CONSTANT_MEMORY
            10 => 32,                                            // WARP_SIZE
            11 => i32::MAX,                                      // MAX_PITCH
            12 => 65536,                                         // MAX_REGISTERS_PER_BLOCK
            13 => self.clock_khz,                                // CLOCK_RATE
            14 => 512,                                           // TEXTURE_ALIGNMENT
            15 => 1,                                             // GPU_OVERLAP
            16 => self.sms,                                      // MULTIPROCESSOR_COUNT
            17 => 0,                                             // KERNEL_EXEC_TIMEOUT
            18 => 0,                                             // INTEGRATED
            19 => 1,                                             // CAN_MAP_HOST_MEMORY
            20 => 0,                                             // COMPUTE_MODE (default)
            31 => 1,                                             // CONCURRENT_KERNELS
            32 => 1,                                             // ECC_ENABLED
            33 => self.pci.1,                                    // PCI_BUS_ID
            34 => self.pci.2,                                    // PCI_DEVICE_ID
            35 => 0,                                             // TCC_DRIVER
            36 => self.mem_clock_khz,                            // MEMORY_CLOCK_RATE
            37 => self.bus_width,                                // GLOBAL_MEMORY_BUS_WIDTH
            38 => self.l2,                                       // L2_CACHE_SIZE
            39 => 2048,                                          // MAX_THREADS_PER_MULTIPROCESSOR
            40 => 3,                                             // ASYNC_ENGINE_COUNT
            41 => 1,                                             // UNIFIED_ADDRESSING
            50 => self.pci.0,                                    // PCI_DOMAIN_ID
            75 => self.cc.0,                                     // COMPUTE_CAPABILITY_MAJOR
            76 => self.cc.1,                                     // COMPUTE_CAPABILITY_MINOR
            78 => 1,                                             // STREAM_PRIORITIES_SUPPORTED
            79 | 80 => 1,                                        // GLOBAL/LOCAL_L1_CACHE_SUPPORTED
            81 => self.smem_sm,    // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
            82 => 65536,           // MAX_REGISTERS_PER_MULTIPROCESSOR
            83 => 1,               // MANAGED_MEMORY
            84 => 0,               // MULTI_GPU_BOARD
            86 => 0,               // HOST_NATIVE_ATOMIC_SUPPORTED
            88 => 0,               // PAGEABLE_MEMORY_ACCESS
            89 => 1,               // CONCURRENT_MANAGED_ACCESS
            90 => 1,               // COMPUTE_PREEMPTION_SUPPORTED
            91 => 0,               // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
            95 => 1,               // COOPERATIVE_LAUNCH
            97 => self.smem_optin, // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            99 => 1,               // HOST_REGISTER_SUPPORTED
            106 => 32,             // MAX_BLOCKS_PER_MULTIPROCESSOR
            111 => 1024,           // RESERVED_SHARED_MEMORY_PER_BLOCK
            115 => i32::from(crate::config::get().memory_pools), // MEMORY_POOLS_SUPPORTED
            _ => return None,
        })
    }
}
