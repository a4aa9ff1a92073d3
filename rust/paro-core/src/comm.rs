//! The vocabulary shared by the planner (how one collective runs on the sub-communicators) and the cost model
//! (which collectives a training step runs, and what they cost).

use serde::{Deserialize, Serialize};

/// Which ranks take part in a collective, or in one step of a hierarchical collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// The m ranks of one group (fast links).
    Intra,
    /// The g ranks of equal local rank, one per group: a rail (slow links).
    Inter,
    /// All n ranks: hierarchically (an intra and an inter phase) or as one flat collective.
    Global,
}

/// A collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Every rank ends with every rank's input, concatenated in rank order.
    AllGather,
    /// Every rank ends with its 1/k slice of the elementwise reduction.
    ReduceScatter,
    /// Every rank ends with the whole reduction.
    AllReduce,
    /// Every rank ends with the root's buffer.
    Broadcast,
    /// The root ends with the reduction.
    Reduce,
    /// No data; returns when every rank has entered.
    Barrier,
}
