//! Topology: n ranks as g groups of m fast-linked ranks, rank = k·m + r (group k, local rank r).

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};

/// The data-parallel world as g groups of m ranks. Invariant: m ≥ 1 divides n ≥ 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Topology {
    /// Number of ranks, n.
    pub world: usize,
    /// Ranks per group, m (e.g. GPUs of one node).
    pub group_size: usize,
}

impl Topology {
    /// Checks that `group_size` divides `world`.
    pub fn new(world: usize, group_size: usize) -> Result<Self> {
        if world == 0 {
            return Err(ParoError::Topology("world size must be at least 1".into()));
        }
        if group_size == 0 {
            return Err(ParoError::Topology(
                "group size must be at least 1; pass the number of fast-linked ranks per group (e.g. GPUs per node)"
                    .into(),
            ));
        }
        if !world.is_multiple_of(group_size) {
            let divisors: Vec<String> =
                (1..=world).filter(|d| world.is_multiple_of(*d)).map(|d| d.to_string()).collect();
            return Err(ParoError::Topology(format!(
                "world size {world} is not divisible by group size {group_size}; pass a group size that divides {world} ({})",
                divisors.join(", ")
            )));
        }
        Ok(Topology { world, group_size })
    }

    /// Number of groups, g = n / m.
    pub fn num_groups(&self) -> usize {
        self.world / self.group_size
    }

    /// Checks a rank.
    pub fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world {
            return Err(ParoError::Topology(format!("rank {rank} is out of range for world size {}", self.world)));
        }
        Ok(())
    }

    /// The group index k of a rank.
    pub fn group_of(&self, rank: usize) -> usize {
        rank / self.group_size
    }

    /// The local rank r of a rank inside its group.
    pub fn local_rank(&self, rank: usize) -> usize {
        rank % self.group_size
    }

    /// The ranks of the group that holds `rank` (intra-group, fast links), in local-rank order.
    pub fn intra_ranks(&self, rank: usize) -> Vec<usize> {
        let k = self.group_of(rank);
        (0..self.group_size).map(|r| k * self.group_size + r).collect()
    }

    /// The ranks with the same local rank as `rank`, one per group (inter-group, same rail), in group order.
    pub fn inter_ranks(&self, rank: usize) -> Vec<usize> {
        let r = self.local_rank(rank);
        (0..self.num_groups()).map(|k| k * self.group_size + r).collect()
    }

    /// Every intra-group rank list, group by group (what each rank must create, in this order).
    pub fn all_intra_groups(&self) -> Vec<Vec<usize>> {
        (0..self.num_groups()).map(|k| self.intra_ranks(k * self.group_size)).collect()
    }

    /// Every inter-group (rail) rank list, local rank by local rank.
    pub fn all_inter_groups(&self) -> Vec<Vec<usize>> {
        (0..self.group_size).map(|r| self.inter_ranks(r)).collect()
    }
}

/// How a process group's members map onto hierarchical groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubgroupShape {
    /// The hierarchical topology of the sub-group, if its members form whole, equal, ordered groups.
    pub topology: Option<Topology>,
    /// Why the sub-group falls back to a flat algorithm, when it does.
    pub flat_reason: Option<String>,
}

/// Derives the topology of a process group from its members' global ranks and the global group size.
///
/// Members must be listed group-major (sorted by global rank) with the same count in every group that
/// appears; otherwise the collective runs flat and `flat_reason` says why.
pub fn subgroup_shape(global_ranks: &[usize], global_group_size: usize) -> Result<SubgroupShape> {
    if global_group_size == 0 {
        return Err(ParoError::Topology("group size must be at least 1".into()));
    }
    if global_ranks.is_empty() {
        return Err(ParoError::Topology("a process group needs at least one rank".into()));
    }
    let flat = |why: String| Ok(SubgroupShape { topology: None, flat_reason: Some(why) });
    if global_ranks.windows(2).any(|w| w[0] >= w[1]) {
        return flat(format!("its ranks {global_ranks:?} are not in increasing order"));
    }
    let mut counts: Vec<(usize, usize)> = Vec::new();
    for &g in global_ranks {
        let k = g / global_group_size;
        match counts.last_mut() {
            Some((last, c)) if *last == k => *c += 1,
            _ => counts.push((k, 1)),
        }
    }
    let per_group = counts[0].1;
    if counts.iter().any(|&(_, c)| c != per_group) {
        let desc: Vec<String> = counts.iter().map(|(k, c)| format!("group {k}: {c}")).collect();
        return flat(format!(
            "its ranks do not take the same number of ranks from every group of {global_group_size} ({})",
            desc.join(", ")
        ));
    }
    Ok(SubgroupShape { topology: Some(Topology::new(global_ranks.len(), per_group)?), flat_reason: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_and_groups() {
        let t = Topology::new(8, 4).unwrap();
        assert_eq!(t.num_groups(), 2);
        assert_eq!((t.group_of(6), t.local_rank(6)), (1, 2));
        assert_eq!(t.intra_ranks(6), vec![4, 5, 6, 7]);
        assert_eq!(t.inter_ranks(6), vec![2, 6]);
        assert_eq!(t.all_inter_groups(), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert_eq!(t.all_intra_groups(), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    }

    #[test]
    fn not_divisible_is_a_clear_error() {
        let e = Topology::new(6, 4).unwrap_err().to_string();
        assert!(e.contains("world size 6 is not divisible by group size 4"), "{e}");
        assert!(e.contains("1, 2, 3, 6"), "{e}");
        assert!(Topology::new(4, 0).is_err());
        assert!(Topology::new(0, 1).is_err());
    }

    #[test]
    fn subgroups() {
        let s = subgroup_shape(&[0, 1, 2, 3], 2).unwrap();
        assert_eq!(s.topology, Some(Topology { world: 4, group_size: 2 }));
        // one rank per group: a pure inter-group (rail) group
        let s = subgroup_shape(&[1, 3], 2).unwrap();
        assert_eq!(s.topology, Some(Topology { world: 2, group_size: 1 }));
        // inside one group
        let s = subgroup_shape(&[4, 5, 6, 7], 4).unwrap();
        assert_eq!(s.topology, Some(Topology { world: 4, group_size: 4 }));
        // uneven
        let s = subgroup_shape(&[0, 1, 2], 2).unwrap();
        assert!(s.topology.is_none() && s.flat_reason.unwrap().contains("same number"));
        // members on other local ranks still pair up group by group
        let s = subgroup_shape(&[0, 3], 2).unwrap();
        assert_eq!(s.topology, Some(Topology { world: 2, group_size: 1 }));
        let s = subgroup_shape(&[0, 1, 6, 7], 4).unwrap();
        assert_eq!(s.topology, Some(Topology { world: 4, group_size: 2 }));
        let s = subgroup_shape(&[1, 0], 2).unwrap();
        assert!(s.flat_reason.unwrap().contains("increasing"));
    }
}
