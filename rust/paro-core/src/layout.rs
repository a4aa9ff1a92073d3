//! Per-parameter shard layout (nested, as in PaRO-DP, arXiv 2310.06003): each parameter is split along its first dimension
//! (rows) the way `torch.chunk` splits it, first into m I-chunks by local rank r, then each I-chunk into g
//! G-chunks by group k, so the G-chunk of rank (k, r) nests in its I-chunk. These are exactly the local
//! shards of a DTensor with placements `(Shard(0), Shard(0))` on the (intra, inter) mesh (or
//! `(Shard(0), Replicate())` for I), so an optimizer sees each parameter's shard under its own name.
//!
//! For communication the parameters of one unit are packed into one flat buffer of equal *blocks*, one per
//! shard at the buffer's finest granularity (1 for N, m for I, n for G, block r·g + k for G): inside a block
//! each parameter has a slot of the largest chunk's rows, holding its chunk's rows first and padding after.
//! At N the one block is padded to a multiple of n. Rank (k, r) then holds block(s) `[r·n/m + ...]` contiguously at every coarser granularity, so N↔I is one
//! intra-group collective and I↔G one inter-group collective on the same flat buffer.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};
use crate::strategy::Granularity;
use crate::topology::Topology;

/// One parameter as the layout sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRows {
    /// Size of the first dimension (1 for a 0-dimensional parameter).
    pub rows: u64,
    /// Elements per row (the product of the other dimensions).
    pub row_numel: u64,
    /// Held whole by every block instead of split (0-dimensional parameters, which have no rows to split).
    pub replicated: bool,
}

/// Where one parameter lies in every block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamPlace {
    /// Offset of the parameter's slot inside a block, in elements.
    pub offset: u64,
    /// Rows of the slot (the largest chunk); the chunk's rows come first, padding after.
    pub slot_rows: u64,
    /// `(first row, rows)` of the parameter held by each block, in block order.
    pub chunks: Vec<(u64, u64)>,
}

/// The parameters of one flat buffer laid out in equal blocks at one granularity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowLayout {
    /// The granularity of the blocks.
    pub granularity: Granularity,
    /// Number of blocks: 1 (N), m (I) or n (G).
    pub blocks: usize,
    /// Elements per block.
    pub block_numel: u64,
    /// Each parameter's place, in the order given.
    pub params: Vec<ParamPlace>,
    topology: Topology,
}

/// `torch.chunk`'s split of `len` rows into `parts`: the `(offset, rows)` of chunk `index` (empty past the end).
pub fn chunk(len: u64, parts: u64, index: u64) -> (u64, u64) {
    let size = len.div_ceil(parts.max(1));
    let start = (size * index).min(len);
    (start, (start + size).min(len) - start)
}

impl RowLayout {
    /// Lays out `params` in blocks of granularity `granularity` over `topology`.
    pub fn new(params: &[ParamRows], granularity: Granularity, topology: Topology) -> Result<Self> {
        let (m, g) = (topology.group_size as u64, topology.num_groups() as u64);
        let blocks = granularity.degree(topology.group_size, topology.world);
        let overflow = || ParoError::Invalid("a flat buffer larger than 2^64 elements".into());
        let mut offset: u64 = 0;
        let mut places = Vec::with_capacity(params.len());
        for p in params {
            let chunks: Vec<(u64, u64)> = (0..blocks as u64)
                .map(|b| match (granularity, p.replicated) {
                    (Granularity::N, _) | (_, true) => (0, p.rows),
                    (Granularity::I, false) => chunk(p.rows, m, b),
                    (Granularity::G, false) => {
                        let (r, k) = (b / g, b % g);
                        let (start, len) = chunk(p.rows, m, r);
                        let (sub, rows) = chunk(len, g, k);
                        (start + sub, rows)
                    }
                })
                .collect();
            let slot_rows = chunks.iter().map(|c| c.1).max().unwrap_or(0);
            places.push(ParamPlace { offset, slot_rows, chunks });
            let numel = slot_rows.checked_mul(p.row_numel).ok_or_else(overflow)?;
            offset = offset.checked_add(numel).ok_or_else(overflow)?;
        }
        if granularity == Granularity::N {
            // one block, padded to a multiple of n so that it can be reduce-scattered at either level
            let n = topology.world as u64;
            offset = offset.div_ceil(n).checked_mul(n).ok_or_else(overflow)?;
        }
        offset.checked_mul(blocks as u64).ok_or_else(overflow)?;
        Ok(RowLayout { granularity, blocks, block_numel: offset, params: places, topology })
    }

    /// Elements of the whole buffer, padding included.
    pub fn padded(&self) -> u64 {
        self.block_numel * self.blocks as u64
    }

    /// The elements of the whole buffer that `rank` holds at `gran` (one of the layout's granularity or
    /// coarser): all blocks for N, its group's share of blocks for I, its own block for G.
    pub fn range(&self, gran: Granularity, rank: usize) -> Result<Range<u64>> {
        let t = &self.topology;
        let (n, m) = (t.world, t.group_size);
        if gran.degree(m, n) > self.blocks {
            return Err(ParoError::Invalid(format!(
                "a buffer laid out at {:?} has no {gran:?} shards",
                self.granularity
            )));
        }
        let per = self.blocks / gran.degree(m, n);
        let first = match gran {
            Granularity::N => 0,
            Granularity::I => t.local_rank(rank) * per,
            Granularity::G => t.local_rank(rank) * t.num_groups() + t.group_of(rank),
        };
        let b = self.block_numel;
        Ok(first as u64 * b..(first + per) as u64 * b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rows(r: u64, c: u64) -> ParamRows {
        ParamRows { rows: r, row_numel: c, replicated: false }
    }

    #[test]
    fn example_2x2() {
        let t = Topology::new(4, 2).unwrap();
        // 9 rows: I-chunks 5 + 4; G-chunks (3, 2) and (2, 2), as DTensor's (Shard(0), Shard(0))
        let l = RowLayout::new(&[rows(9, 3), ParamRows { rows: 1, row_numel: 1, replicated: true }], Granularity::G, t)
            .unwrap();
        assert_eq!(l.params[0].chunks, vec![(0, 3), (3, 2), (5, 2), (7, 2)]);
        assert_eq!(l.params[0].slot_rows, 3);
        assert_eq!(l.params[1], ParamPlace { offset: 9, slot_rows: 1, chunks: vec![(0, 1); 4] });
        assert_eq!(l.block_numel, 10);
        // rank 1 = (k=0, r=1) holds block 2 at G and blocks 2..4 at I
        assert_eq!(l.range(Granularity::G, 1).unwrap(), 20..30);
        assert_eq!(l.range(Granularity::I, 1).unwrap(), 20..40);
        assert_eq!(l.range(Granularity::N, 1).unwrap(), 0..40);
        let i = RowLayout::new(&[rows(9, 3)], Granularity::I, t).unwrap();
        assert_eq!(i.params[0].chunks, vec![(0, 5), (5, 4)]);
        assert!(i.range(Granularity::G, 0).is_err());
        assert_eq!(chunk(3, 4, 3), (3, 0), "torch.chunk leaves the last chunks empty");
    }

    fn topo() -> impl Strategy<Value = Topology> {
        (1usize..=5, 1usize..=5).prop_map(|(g, m)| Topology::new(g * m, m).unwrap())
    }

    proptest! {
        #[test]
        fn chunks_tile_rows_and_nest(shapes in proptest::collection::vec((0u64..30, 1u64..4), 0..5), t in topo()) {
            let params: Vec<ParamRows> = shapes.iter().map(|&(r, c)| rows(r, c)).collect();
            let gl = RowLayout::new(&params, Granularity::G, t).unwrap();
            let il = RowLayout::new(&params, Granularity::I, t).unwrap();
            for (p, place) in params.iter().zip(&gl.params) {
                // in block order the chunks cover the rows once, in order
                let mut next = 0;
                for &(start, len) in &place.chunks {
                    prop_assert!(len <= place.slot_rows);
                    if len > 0 { prop_assert_eq!(start, next); }
                    next += len;
                }
                prop_assert_eq!(next, p.rows);
            }
            for rank in 0..t.world {
                // the G-chunks of the blocks rank holds at I make up its I-chunk
                let r = t.local_rank(rank);
                let range = gl.range(Granularity::I, rank).unwrap();
                let (b0, b1) = ((range.start / gl.block_numel.max(1)) as usize, (range.end / gl.block_numel.max(1)) as usize);
                for (gp, ip) in gl.params.iter().zip(&il.params) {
                    let rows: u64 = if gl.block_numel == 0 { 0 } else { gp.chunks[b0..b1].iter().map(|c| c.1).sum() };
                    if gl.block_numel > 0 { prop_assert_eq!(rows, ip.chunks[r].1); }
                }
                let g = gl.range(Granularity::G, rank).unwrap();
                prop_assert!(range.start <= g.start && g.end <= range.end, "G nests in I");
            }
        }
    }
}
