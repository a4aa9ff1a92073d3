//! Nested shard layout: every flat buffer is padded to a multiple of the world size n, and
//! G-shard ⊂ I-shard ⊂ buffer on every rank, so N↔I is an intra-group collective and I↔G an
//! inter-group one among same-local-rank peers (paro-spec §3).
//!
//! Rank (k, r) — group k, local rank r — holds I-shard r = `[r·P/m, (r+1)·P/m)` and G-shard
//! `[r·P/m + k·P/n, r·P/m + (k+1)·P/n)`, i.e. global block index r·g + k.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};
use crate::strategy::Granularity;
use crate::topology::Topology;

/// `numel` rounded up to a multiple of the world size.
pub fn padded_numel(numel: u64, world: usize) -> u64 {
    let n = world as u64;
    numel.div_ceil(n) * n
}

/// The shards of one flat buffer of `numel` elements over a topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardLayout {
    /// Elements that carry data.
    pub numel: u64,
    /// `numel` padded to a multiple of the world size.
    pub padded: u64,
    /// The world as groups.
    pub topology: Topology,
}

impl ShardLayout {
    /// Lays out a buffer of `numel` elements.
    pub fn new(numel: u64, topology: Topology) -> Self {
        ShardLayout { numel, padded: padded_numel(numel, topology.world), topology }
    }

    /// Elements per shard at a granularity (the whole padded buffer for N).
    pub fn shard_numel(&self, gran: Granularity) -> u64 {
        self.padded / gran.degree(self.topology.group_size, self.topology.world) as u64
    }

    /// The range of the padded buffer that `rank` holds at a granularity.
    pub fn shard_range(&self, gran: Granularity, rank: usize) -> Range<u64> {
        let t = &self.topology;
        let (k, r) = (t.group_of(rank) as u64, t.local_rank(rank) as u64);
        let i_len = self.shard_numel(Granularity::I);
        let g_len = self.shard_numel(Granularity::G);
        match gran {
            Granularity::N => 0..self.padded,
            Granularity::I => r * i_len..(r + 1) * i_len,
            Granularity::G => {
                let start = r * i_len + k * g_len;
                start..start + g_len
            }
        }
    }

    /// Position of `rank`'s G-shard among the n G-shards of the buffer (r·g + k).
    pub fn g_block_index(&self, rank: usize) -> usize {
        let t = &self.topology;
        t.local_rank(rank) * t.num_groups() + t.group_of(rank)
    }
}

/// Where part of one parameter lies inside one shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Index of the parameter in the buffer.
    pub param: usize,
    /// Offset inside the (flattened) parameter.
    pub param_offset: u64,
    /// Offset inside the shard.
    pub shard_offset: u64,
    /// Number of elements.
    pub numel: u64,
}

/// Several parameters packed back to back in one flat buffer, and their shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatLayout {
    /// Offset of each parameter in the buffer.
    pub offsets: Vec<u64>,
    /// Element count of each parameter.
    pub numels: Vec<u64>,
    /// The buffer's shards.
    pub shards: ShardLayout,
}

impl FlatLayout {
    /// Packs parameters of the given element counts.
    pub fn new(numels: &[u64], topology: Topology) -> Result<Self> {
        let mut offsets = Vec::with_capacity(numels.len());
        let mut total: u64 = 0;
        for &n in numels {
            offsets.push(total);
            total = total
                .checked_add(n)
                .ok_or_else(|| ParoError::Invalid("flat buffer larger than 2^64 elements".into()))?;
        }
        Ok(FlatLayout { offsets, numels: numels.to_vec(), shards: ShardLayout::new(total, topology) })
    }

    /// The parts of parameters that fall into `rank`'s shard at a granularity, in buffer order.
    pub fn pieces(&self, gran: Granularity, rank: usize) -> Vec<Piece> {
        let range = self.shards.shard_range(gran, rank);
        let mut out = Vec::new();
        for (param, (&off, &n)) in self.offsets.iter().zip(&self.numels).enumerate() {
            let start = off.max(range.start);
            let end = (off + n).min(range.end);
            if start < end {
                out.push(Piece {
                    param,
                    param_offset: start - off,
                    shard_offset: start - range.start,
                    numel: end - start,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn example_2x2() {
        let t = Topology::new(4, 2).unwrap();
        let l = ShardLayout::new(10, t);
        assert_eq!(l.padded, 12);
        assert_eq!(l.shard_range(Granularity::I, 3), 6..12);
        // rank 3 = (k=1, r=1): I-shard 6..12, G-shard is its second half
        assert_eq!(l.shard_range(Granularity::G, 3), 9..12);
        assert_eq!(l.shard_range(Granularity::G, 1), 6..9);
        assert_eq!(l.g_block_index(1), 2);
        let f = FlatLayout::new(&[3, 4, 3], t).unwrap();
        assert_eq!(f.pieces(Granularity::G, 2), vec![Piece { param: 1, param_offset: 0, shard_offset: 0, numel: 3 }]);
        assert_eq!(
            f.pieces(Granularity::I, 0),
            vec![
                Piece { param: 0, param_offset: 0, shard_offset: 0, numel: 3 },
                Piece { param: 1, param_offset: 0, shard_offset: 3, numel: 3 }
            ]
        );
    }

    fn topo() -> impl Strategy<Value = Topology> {
        (1usize..=6, 1usize..=6).prop_map(|(g, m)| Topology::new(g * m, m).unwrap())
    }

    proptest! {
        #[test]
        fn shards_tile_and_nest(numel in 0u64..500, t in topo()) {
            let l = ShardLayout::new(numel, t);
            prop_assert!(l.padded >= numel && l.padded.is_multiple_of(t.world as u64) && l.padded - numel < t.world as u64);
            for gran in Granularity::ALL {
                // the shards of one replica tile the buffer: collect the ranges of ranks that hold distinct shards
                let holders: Vec<usize> = match gran {
                    Granularity::N => vec![0],
                    Granularity::I => t.intra_ranks(0),
                    Granularity::G => (0..t.world).collect(),
                };
                let mut ranges: Vec<Range<u64>> = holders.iter().map(|&r| l.shard_range(gran, r)).collect();
                ranges.sort_by_key(|r| r.start);
                let mut next = 0;
                for r in &ranges {
                    prop_assert_eq!(r.start, next);
                    prop_assert_eq!(r.end - r.start, l.shard_numel(gran));
                    next = r.end;
                }
                prop_assert_eq!(next, l.padded);
            }
            for rank in 0..t.world {
                let gs = l.shard_range(Granularity::G, rank);
                let is = l.shard_range(Granularity::I, rank);
                prop_assert!(is.start <= gs.start && gs.end <= is.end, "G-shard nests in I-shard");
                prop_assert_eq!(gs.start, l.g_block_index(rank) as u64 * l.shard_numel(Granularity::G));
                // I-shards are replicated across groups: same local rank, same range
                for peer in t.inter_ranks(rank) {
                    prop_assert_eq!(l.shard_range(Granularity::I, peer), is.clone());
                }
            }
        }

        #[test]
        fn pieces_cover_every_element_once(numels in proptest::collection::vec(0u64..40, 0..6), t in topo()) {
            let f = FlatLayout::new(&numels, t).unwrap();
            for gran in Granularity::ALL {
                let mut seen: Vec<Vec<u32>> = numels.iter().map(|&n| vec![0; n as usize]).collect();
                let holders: Vec<usize> = match gran {
                    Granularity::N => vec![0],
                    Granularity::I => t.intra_ranks(0),
                    Granularity::G => (0..t.world).collect(),
                };
                for rank in holders {
                    let range = f.shards.shard_range(gran, rank);
                    for p in f.pieces(gran, rank) {
                        prop_assert!(p.shard_offset + p.numel <= range.end - range.start);
                        prop_assert_eq!(f.offsets[p.param] + p.param_offset, range.start + p.shard_offset);
                        for i in 0..p.numel {
                            seen[p.param][(p.param_offset + i) as usize] += 1;
                        }
                    }
                }
                prop_assert!(seen.iter().all(|s| s.iter().all(|&c| c == 1)));
            }
        }
    }
}
