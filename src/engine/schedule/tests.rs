use super::hazards::touches_job;
use super::*;

fn spec(layers: usize, tied: bool, mb: usize, mode: Mode, a: Activations) -> ScheduleSpec {
    ScheduleSpec {
        lean_pieces: LeanPieces::WHOLE,
        ranks: 1,
        gather: Gather::No,
        land: false,
        layers,
        tied,
        micro_batches: mb,
        mode,
        activations: a,
        activation_dtype: ActivationDtype::Fp32,
        device_inputs: 0,
    }
}

fn all_specs() -> Vec<ScheduleSpec> {
    let mut v = Vec::new();
    for layers in [1, 2, 5] {
        for tied in [false, true] {
            for a in [Activations::Device, Activations::Host, Activations::Keep] {
                v.push(spec(layers, tied, 1, Mode::Exact, a));
                v.push(spec(layers, tied, 3, Mode::Exact, a));
                v.push(spec(layers, tied, 1, Mode::Lean, a));
                // Layer inputs stored in bf16.
                v.push(ScheduleSpec {
                    activation_dtype: ActivationDtype::Bf16,
                    ..spec(layers, tied, 2, Mode::Exact, a)
                });
                // Host activations with the last inputs kept on the device, in fp32 and bf16.
                if a == Activations::Host {
                    for k in 1..=layers {
                        for dtype in [ActivationDtype::Fp32, ActivationDtype::Bf16] {
                            v.push(ScheduleSpec {
                                activation_dtype: dtype,
                                device_inputs: k,
                                ..spec(layers, tied, 2, Mode::Exact, a)
                            });
                        }
                    }
                }
                // Data parallel: each unit's gradients summed across ranks.
                v.push(ScheduleSpec {
                    ranks: 3,
                    ..spec(layers, tied, 2, Mode::Exact, a)
                });
                v.push(ScheduleSpec {
                    ranks: 2,
                    ..spec(layers, tied, 1, Mode::Lean, a)
                });
                // ZeRO stage 3: each copy of a unit's params after its gather.
                v.push(ScheduleSpec {
                    ranks: 3,
                    gather: Gather::Host,
                    ..spec(layers, tied, 2, Mode::Exact, a)
                });
                // Sharded gradients: each unit's landed in one of two buffers in turn, every
                // micro-batch's.
                for micro in [1, 2] {
                    v.push(ScheduleSpec {
                        ranks: 3,
                        gather: Gather::Host,
                        land: true,
                        ..spec(layers, tied, micro, Mode::Exact, a)
                    });
                }
                v.push(ScheduleSpec {
                    ranks: 2,
                    gather: Gather::Host,
                    ..spec(layers, tied, 1, Mode::Lean, a)
                });
                // The devices gather: the owner's copy, then the broadcast, one device op.
                v.push(ScheduleSpec {
                    ranks: 3,
                    gather: Gather::Device,
                    land: true,
                    ..spec(layers, tied, 1, Mode::Exact, a)
                });
                v.push(ScheduleSpec {
                    ranks: 2,
                    gather: Gather::Device,
                    ..spec(layers, tied, 1, Mode::Lean, a)
                });
                // A large vocabulary's embedding and head drained and updated in pieces.
                v.push(ScheduleSpec {
                    lean_pieces: LeanPieces {
                        embedding: 3,
                        block: 1,
                        head: 4,
                    },
                    ..spec(layers, tied, 1, Mode::Lean, a)
                });
            }
        }
    }
    v
}

/// Whether task j (earlier) completes before task i starts: through waits, lane order
/// (except that an Adam task's job is not ordered by the host lane), transitively.
fn ordered(s: &Schedule) -> Vec<Vec<bool>> {
    let t = &s.tasks;
    let n = t.len();
    let mut before = vec![vec![false; n]; n];
    for i in 0..n {
        for j in 0..i {
            let adam_job = matches!(t[j].op, Op::Adam { .. });
            if t[i].waits.contains(&j) || (t[j].lane == t[i].lane && !adam_job) {
                before[i][j] = true;
            }
        }
        for j in 0..i {
            if before[i][j] {
                let (done, row) = before.split_at_mut(i);
                for (k, b) in done[j][..j].iter().enumerate() {
                    row[0][k] |= *b;
                }
            }
        }
    }
    before
}

fn conflict(a: &Task, b: &Task) -> bool {
    if matches!(a.op, Op::Adam { .. }) {
        return touches_job(a, b);
    }
    a.writes
        .iter()
        .any(|r| b.reads.contains(r) || b.writes.contains(r))
        || a.reads.iter().any(|r| b.writes.contains(r))
}

/// Every pair of conflicting accesses within a step is ordered through the waits (an Adam
/// job counts as running until waited for), and every conflict of a task with a task of the
/// previous step that is not a device op (done when the step returns) or a host task (run
/// before it returns) is a cross-step wait.
#[test]
fn every_hazard_is_ordered_within_and_across_steps() {
    for s in all_specs() {
        let p = schedule(&s);
        let before = ordered(&p);
        let t = &p.tasks;
        for i in 0..t.len() {
            for j in 0..i {
                assert!(
                    !conflict(&t[j], &t[i]) || before[i][j],
                    "{s:?}: task {i} {:?} races task {j} {:?}",
                    t[i].op,
                    t[j].op
                );
            }
            // Across steps only AdamW jobs can still run when the next step starts.
            for (j, prev) in t.iter().enumerate() {
                if matches!(prev.op, Op::Adam { .. }) && conflict(prev, &t[i]) {
                    assert!(
                        t[i].prev_waits.contains(&j) || waits_after(&p, i, j),
                        "{s:?}: {:?} does not wait for the previous step's {:?}",
                        t[i].op,
                        prev.op
                    );
                }
            }
        }
    }
}

/// Whether `i` is ordered after the previous step's `j` some other way: an earlier task of
/// this step on its lane waited for `j`, or (lean) the previous step ended after every job.
fn waits_after(p: &Schedule, i: usize, j: usize) -> bool {
    let lean_end = p.tasks.iter().any(|t| t.op == Op::LeanNorm);
    lean_end
        || p.tasks[..i]
            .iter()
            .any(|t| t.lane == p.tasks[i].lane && t.prev_waits.contains(&j))
}

/// The waits across steps the streamer used to code by hand are the schedule's: a unit's
/// weights are copied only after its previous update, exact-mode gradients land only after
/// the previous update read them, a lean step's clip waits for the previous norm.
#[test]
fn cross_step_waits_are_derived() {
    let s = spec(3, false, 2, Mode::Exact, Activations::Host);
    let p = schedule(&s);
    let adam_of = |u: usize| {
        p.tasks
            .iter()
            .position(|t| matches!(t.op, Op::Adam { unit, .. } if unit == u))
            .unwrap()
    };
    for (i, t) in p.tasks.iter().enumerate() {
        match t.op {
            Op::CopyWeights { unit, .. } => {
                let first = p.tasks[..i]
                    .iter()
                    .all(|x| !matches!(x.op, Op::CopyWeights { unit: u, .. } if u == unit));
                if first {
                    assert!(t.prev_waits.contains(&adam_of(unit)), "{:?}", t.op);
                }
            }
            Op::CopyGrads {
                unit,
                accumulate: false,
                ..
            } => assert!(t.prev_waits.contains(&adam_of(unit)), "{:?}", t.op),
            _ => {}
        }
    }
    // Lean: the clip reads the previous step's norm, which the host lane ran before it.
    let lean = schedule(&spec(2, true, 1, Mode::Lean, Activations::Host));
    let clip = lean.tasks.iter().position(|t| t.op == Op::Clip).unwrap();
    let norm = lean
        .tasks
        .iter()
        .position(|t| t.op == Op::LeanNorm)
        .unwrap();
    assert!(clip < norm && lean.tasks[clip].lane == Lane::Host);
    assert!(lean.tasks[norm].writes.contains(&Res::Norm));
    assert!(lean.tasks[clip].reads.contains(&Res::Norm));
    // The lean norm waits for every update of its step.
    let adams: Vec<usize> = (0..lean.tasks.len())
        .filter(|&i| matches!(lean.tasks[i].op, Op::Adam { .. }))
        .collect();
    assert!(adams.iter().all(|a| lean.tasks[norm].waits.contains(a)));
}

#[test]
fn weights_cross_at_most_twice_per_micro_batch() {
    for s in all_specs() {
        let p = schedule(&s);
        for u in 0..s.layers + 2 {
            let n = p
                .tasks
                .iter()
                .filter(|x| matches!(x.op, Op::CopyWeights { unit, .. } if unit == u))
                .count();
            assert!(n <= 2 * s.micro_batches, "{s:?}: unit {u} copied {n} times");
            assert!(n >= s.micro_batches, "{s:?}: unit {u} never copied");
        }
    }
}

#[test]
fn device_buffers_do_not_grow_with_depth_when_activations_offload() {
    let small = schedule(&spec(2, false, 1, Mode::Exact, Activations::Host)).buffers;
    let deep = schedule(&spec(32, false, 1, Mode::Exact, Activations::Host)).buffers;
    assert_eq!(small, deep);
    let dev = schedule(&spec(32, false, 1, Mode::Exact, Activations::Device)).buffers;
    assert_eq!(dev.iter().filter(|b| matches!(b, DevBuf::A(_))).count(), 33);
    // Kept internals: one buffer per block beside the 33 inputs.
    let keep = schedule(&spec(32, false, 1, Mode::Exact, Activations::Keep)).buffers;
    assert_eq!(
        keep.iter().filter(|b| matches!(b, DevBuf::A(_))).count(),
        33
    );
    assert_eq!(
        keep.iter().filter(|b| matches!(b, DevBuf::K(_))).count(),
        32
    );
}

#[test]
fn every_unit_is_updated_once_per_piece_after_its_gradients_and_prefetched_before() {
    for s in all_specs() {
        let p = schedule(&s);
        for u in 0..s.layers + 2 {
            let pieces = match s.mode {
                Mode::Lean => s.lean_pieces.of_unit(u, s.layers),
                Mode::Exact => 1,
            };
            // Piece k's update, after piece k's copy (exact: the last micro-batch's).
            let adam: Vec<(usize, usize)> = (0..p.tasks.len())
                .filter_map(|i| match p.tasks[i].op {
                    Op::Adam { unit, piece, .. } if unit == u => Some((i, piece)),
                    _ => None,
                })
                .collect();
            assert_eq!(
                adam.iter().map(|a| a.1).collect::<Vec<_>>(),
                (0..pieces).collect::<Vec<_>>(),
                "{s:?} unit {u}"
            );
            for &(i, piece) in &adam {
                let drain = (0..p.tasks.len())
                    .filter(|&j| {
                        matches!(p.tasks[j].op, Op::CopyGrads { unit, piece: k, .. } if unit == u && k == piece)
                    })
                    .max()
                    .unwrap();
                assert!(i > drain, "{s:?} unit {u} piece {piece}");
            }
            let adam: Vec<usize> = adam.iter().map(|a| a.0).collect();
            let prefetch = p
                .tasks
                .iter()
                .position(|t| t.op == Op::Prefetch { unit: u })
                .unwrap();
            assert!(
                prefetch < adam[0],
                "{s:?}: unit {u} prefetched after its update"
            );
        }
        if s.mode == Mode::Lean {
            // Lean: the head's update starts before the embedding's backward is submitted.
            let adam_head = p
                .tasks
                .iter()
                .position(|x| matches!(x.op, Op::Adam { unit, .. } if unit == s.layers + 1))
                .unwrap();
            let emb_bwd = p
                .tasks
                .iter()
                .position(|x| matches!(x.op, Op::Kernel(Kernel::EmbedBwd { .. })))
                .unwrap();
            assert!(adam_head < emb_bwd);
        }
    }
}

/// A lean copy that refills a buffer waits (on the host) for the AdamW job that read it: the
/// device must have a kernel queued meanwhile. So between such a job and the copy waiting for
/// it there is a kernel, unless no kernel follows the copy in the step (its tail).
#[test]
fn a_copy_waiting_for_adamw_has_a_kernel_queued_before_it() {
    for s in all_specs().into_iter().filter(|s| s.mode == Mode::Lean) {
        let p = schedule(&s);
        let kernel = |i: usize| matches!(p.tasks[i].op, Op::Kernel(_));
        let last_kernel = (0..p.tasks.len()).filter(|&i| kernel(i)).max().unwrap();
        for (c, t) in p.tasks.iter().enumerate() {
            if !matches!(t.op, Op::CopyGrads { .. }) || c > last_kernel {
                continue;
            }
            for &a in &t.waits {
                if matches!(p.tasks[a].op, Op::Adam { .. }) {
                    assert!(
                        (a + 1..c).any(kernel),
                        "{s:?}: copy {c} waits for AdamW {a} with no kernel queued between"
                    );
                }
            }
        }
    }
}

/// Data parallel: every gradient copy of the step is summed across ranks exactly once, after
/// its last copy to the host and before anything reads it (the norm, the update); one rank's
/// schedule has no sum.
#[test]
fn data_parallel_sums_each_gradient_once_before_it_is_read() {
    for base in all_specs() {
        let one = schedule(&ScheduleSpec { ranks: 1, ..base });
        assert!(!one.tasks.iter().any(|t| matches!(t.op, Op::Reduce { .. })));
        let s = schedule(&ScheduleSpec { ranks: 2, ..base });
        let ord = ordered(&s);
        let reduces: Vec<usize> = (0..s.tasks.len())
            .filter(|&i| matches!(s.tasks[i].op, Op::Reduce { .. }))
            .collect();
        assert!(!reduces.is_empty());
        for &r in &reduces {
            let Op::Reduce {
                unit, lean, piece, ..
            } = s.tasks[r].op
            else {
                unreachable!()
            };
            let res = lean.map_or(Res::Grads(unit), Res::Lean);
            // The last copy into what it sums is ordered before it …
            let copy = (0..r)
                .rev()
                .find(|&j| {
                    s.tasks[j].writes.contains(&res)
                        && matches!(s.tasks[j].op, Op::CopyGrads { .. })
                })
                .expect("a copy before the sum");
            assert!(ord[r][copy], "{base:?}: sum {r} not after copy {copy}");
            // … and the norm or update reading the sum after it.
            let reader = (r + 1..s.tasks.len())
                .find(|&j| {
                    matches!(s.tasks[j].op, Op::Norm { unit: u } if u == unit)
                        || matches!(s.tasks[j].op, Op::Adam { unit: u, piece: p, .. } if u == unit && p == piece)
                })
                .expect("a reader after the sum");
            assert!(
                ord[reader][r],
                "{base:?}: reader {reader} not after sum {r}"
            );
        }
        // As many sums as there are gradient copies that end a unit's step — with sharded
        // gradients, as gradient copies (each micro-batch's summed at once, a later one's
        // added to the owner's shard).
        if base.land {
            let copies: Vec<(usize, Option<usize>, bool)> = s
                .tasks
                .iter()
                .filter_map(|t| match t.op {
                    Op::CopyGrads {
                        unit,
                        landing,
                        accumulate,
                        ..
                    } => Some((unit, landing, accumulate)),
                    _ => None,
                })
                .collect();
            let sums: Vec<(usize, Option<usize>, bool)> = reduces
                .iter()
                .map(|&r| match s.tasks[r].op {
                    Op::Reduce {
                        unit,
                        landing,
                        accumulate,
                        ..
                    } => (unit, landing, accumulate),
                    _ => unreachable!(),
                })
                .collect();
            assert_eq!(sums, copies, "{base:?}");
            assert!(copies.iter().all(|c| c.1.is_some()), "{base:?}");
            assert_eq!(
                copies.iter().filter(|c| c.2).count(),
                (base.layers + 2) * (base.micro_batches - 1),
                "{base:?}"
            );
            continue;
        }
        let last_copies = match base.mode {
            Mode::Exact => base.layers + 2,
            Mode::Lean => s
                .tasks
                .iter()
                .filter(|t| matches!(t.op, Op::CopyGrads { lean: Some(_), .. }))
                .count(),
        };
        assert_eq!(reduces.len(), last_copies, "{base:?}");
    }
}

/// ZeRO stage 3: through the host, every copy of a unit's params follows its gather into the
/// copy's host buffer; on the devices, every copy is the owner's copy and broadcast, with no
/// host gather; unsharded, neither.
#[test]
fn params_are_gathered_before_every_copy_by_the_host_or_the_devices() {
    for s in all_specs() {
        let p = schedule(&s);
        for (i, t) in p.tasks.iter().enumerate() {
            let Op::CopyWeights {
                unit, broadcast, ..
            } = t.op
            else {
                continue;
            };
            assert_eq!(broadcast, s.gather == Gather::Device, "{s:?}: {:?}", t.op);
            let gathered = t.waits.iter().any(|&w| {
                matches!(p.tasks[w].op, Op::Gather { unit: u, .. } if u == unit)
                    && t.reads.contains(&p.tasks[w].writes[0])
            });
            assert_eq!(
                gathered,
                s.gather == Gather::Host,
                "{s:?}: task {i} {:?}",
                t.op
            );
        }
        if s.gather != Gather::Host {
            assert!(
                !p.tasks.iter().any(|t| matches!(t.op, Op::Gather { .. })),
                "{s:?}"
            );
        }
    }
}
