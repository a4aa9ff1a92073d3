//! How the CPU executor of the `paro` backend runs a plan: in plan order, waiting only where a step needs an
//! earlier one.
//!
//! [Note: host schedule] On the CPU the executor walks the steps in plan order (see [Note: order inside a stage]
//! in planner.rs). A communication step is issued asynchronously on its level's sub-communicator (each rank
//! issues the same steps of a level in the same order); a local step (`Copy`, `Combine`) runs at once. Before a
//! step runs or is issued, the executor waits on the communication steps listed in its `waits`: every earlier
//! communication step it shares an element with, where one of the two writes it, and that no earlier wait has
//! covered. Issued steps may run concurrently, those of one level included, so two communication steps that
//! touch a common element are ordered by a wait as well. At the end it waits on every step not waited on yet.
//! Stages then order nothing on the CPU: a level starts its next chunk as soon as the chunk's inputs are there,
//! not when the slowest step of the stage (on any rail of the group) has ended. Every rank waits only on steps
//! that every member of their sub-communicators issues before waiting on anything issued later, so no two ranks
//! wait on each other. `tests/planner_sim.rs` checks that every two conflicting steps of every plan are ordered.

use crate::planner::{Buf, Plan, Region, Step};

/// The contiguous runs of a region, as `[start, end)` element ranges of its buffer; the caller's input and output
/// count as one buffer (they are one for in-place collectives).
fn runs(r: &Region) -> (u8, Vec<(u64, u64)>) {
    let key = match r.buf {
        Buf::Input | Buf::Output => 0,
        Buf::Tmp(i) => 1 + i,
    };
    if r.numel() == 0 {
        return (key, Vec::new());
    }
    let [d0, d1, d2] = r.dims;
    let [s0, s1, s2] = r.strides;
    let mut out = Vec::new();
    if s2 == 1 {
        for a in 0..d0 {
            for b in 0..d1 {
                let start = r.offset + a * s0 + b * s1;
                out.push((start, start + d2));
            }
        }
    } else {
        for idx in r.indices() {
            out.push((idx, idx + 1));
        }
    }
    (key, out)
}

/// Whether two regions share an element.
fn overlap(a: &(u8, Vec<(u64, u64)>), b: &(u8, Vec<(u64, u64)>)) -> bool {
    a.0 == b.0 && a.1.iter().any(|&(s, e)| b.1.iter().any(|&(t, f)| s < f && t < e))
}

/// What a step reads and writes (a communication step that reduces in place reads its destination too, which is
/// its source).
fn touches(step: &Step) -> [(u8, Vec<(u64, u64)>); 2] {
    [runs(&step.src), runs(&step.dst)]
}

fn conflict(a: &[(u8, Vec<(u64, u64)>); 2], b: &[(u8, Vec<(u64, u64)>); 2]) -> bool {
    let ([ra, wa], [rb, wb]) = (a, b);
    overlap(wa, rb) || overlap(wa, wb) || overlap(ra, wb)
}

/// Per step of `plan`, the earlier communication steps (indices into `plan.steps`) the CPU executor waits on
/// before it runs or issues the step (see [Note: host schedule]).
pub fn waits(plan: &Plan) -> Vec<Vec<u32>> {
    let regions: Vec<_> = plan.steps.iter().map(touches).collect();
    let mut out = vec![Vec::new(); plan.steps.len()];
    let mut pending: Vec<usize> = Vec::new(); // issued communication steps not waited on yet
    for (i, step) in plan.steps.iter().enumerate() {
        let (due, rest): (Vec<usize>, Vec<usize>) = pending.iter().partition(|&&j| conflict(&regions[j], &regions[i]));
        out[i] = due.iter().map(|&j| j as u32).collect();
        pending = rest;
        if step.kind.communicates() {
            pending.push(i);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{plan, ChunkPolicy, Collective, Request};
    use crate::Topology;

    fn all_gather(chunks: u32) -> Plan {
        plan(&Request {
            collective: Collective::AllGather,
            topology: Some(Topology::new(4, 2).unwrap()),
            world: 4,
            rank: 1,
            numel: 64,
            elem_size: 4,
            root: 0,
            chunks: ChunkPolicy::fixed(1, chunks),
        })
        .unwrap()
    }

    #[test]
    fn the_next_inter_chunk_is_issued_before_the_walk_waits_on_the_current_one() {
        let p = all_gather(4);
        let w = waits(&p);
        // every intra all-gather waits on exactly its own chunk's inter all-gather, issued one chunk earlier
        let inter: Vec<usize> = (0..p.steps.len()).filter(|&i| p.steps[i].level == crate::Level::Inter).collect();
        assert_eq!(inter.len(), 4);
        for (c, &j) in inter.iter().enumerate() {
            let waiter = (0..p.steps.len()).find(|&i| w[i].contains(&(j as u32))).expect("an inter step never waited");
            assert_eq!(p.steps[waiter].level, crate::Level::Intra);
            if c + 1 < inter.len() {
                assert!(inter[c + 1] < waiter, "chunk {}'s inter step is issued after chunk {c}'s wait", c + 1);
            }
        }
        // the first step waits on nothing, and no step waits twice on one step
        assert!(w[0].is_empty());
        let mut all: Vec<u32> = w.concat();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    #[test]
    fn strided_regions_overlap_only_where_they_share_elements() {
        let strided = Region { buf: Buf::Output, offset: 2, dims: [2, 1, 2], strides: [8, 8, 1] }; // 2..4, 10..12
        for (lo, len, hit) in [(0, 2, false), (1, 2, true), (4, 6, false), (11, 4, true), (12, 9, false)] {
            assert_eq!(overlap(&runs(&strided), &runs(&Region::flat(Buf::Input, lo, len))), hit, "{lo}+{len}");
        }
        assert!(!overlap(&runs(&strided), &runs(&Region::flat(Buf::Tmp(0), 0, 100))));
    }
}
