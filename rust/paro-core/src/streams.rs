//! How a device executor (the CUDA path of the `paro` backend) runs a plan on streams and events.
//!
//! [Note: stream schedule] The executor has one stream (a *lane*) per level for communication steps and one for
//! local steps (`Copy`, `Combine`); `C` is the caller's stream. It records `ready` on `C`; then, stage by stage:
//! every lane the stage uses waits, before its first step of the stage, on the end events of every lane the last
//! stage before it used (a rank may have nothing to do in a stage: such stages are skipped), or on `ready` when
//! there is no such stage; the steps run in plan order on their lanes; a communication step
//! marked `wait_local` first makes its lane wait on an event recorded on the local lane right after the local
//! steps before it in the stage (on the CPU those steps have finished when the step is issued, and the step may
//! read what they wrote); each lane the stage used then records its end event. Finally the local lane waits on the
//! end events of the last stage that used any lane (or on `ready`), and records `done`, which the caller's stream
//! waits on.
//!
//! Ordering across stages further apart is transitive, and within a stage the planner's stage semantics (see
//! planner.rs) leave only the local-before-communication dependencies that `wait_local` covers: so every two
//! steps that touch a common element run in plan order. `tests/planner_sim.rs` checks this for every plan.

use crate::planner::{Level, Plan, Step};

/// The stream a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lane {
    /// Communication at the intra-group level.
    Intra,
    /// Communication at the inter-group level.
    Inter,
    /// Communication over the whole process group.
    Global,
    /// Local copies and combines.
    Local,
}

impl Lane {
    /// All lanes, in bit order.
    pub const ALL: [Lane; 4] = [Lane::Intra, Lane::Inter, Lane::Global, Lane::Local];

    /// This lane's bit in a lane mask.
    pub fn bit(self) -> u8 {
        1 << self as u8
    }

    /// The lane of a step.
    pub fn of(step: &Step) -> Lane {
        if !step.kind.communicates() {
            return Lane::Local;
        }
        match step.level {
            Level::Intra => Lane::Intra,
            Level::Inter => Lane::Inter,
            Level::Global => Lane::Global,
        }
    }
}

/// The stream schedule of a plan (see [Note: stream schedule]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSchedule {
    /// Per stage, the mask of the lanes it uses (0 for a stage where this rank has nothing to do).
    pub stage_lanes: Vec<u8>,
    /// Per step, whether its lane first waits on the local steps before it in its stage.
    pub wait_local: Vec<bool>,
}

/// Derives the stream schedule of a plan.
pub fn schedule(plan: &Plan) -> StreamSchedule {
    let mut stage_lanes = vec![0u8; plan.stages() as usize];
    let mut wait_local = vec![false; plan.steps.len()];
    // local steps of the current stage that the given lane has not waited on yet
    let mut unsynced = [false; 4];
    let mut stage = u32::MAX;
    for (i, step) in plan.steps.iter().enumerate() {
        if step.stage != stage {
            stage = step.stage;
            unsynced = [false; 4];
        }
        let lane = Lane::of(step);
        stage_lanes[step.stage as usize] |= lane.bit();
        if lane == Lane::Local {
            unsynced = [true; 4];
        } else if unsynced[lane as usize] {
            wait_local[i] = true;
            unsynced[lane as usize] = false;
        }
    }
    StreamSchedule { stage_lanes, wait_local }
}
