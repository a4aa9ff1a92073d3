//! The `auto` choice and its explanation.

use std::cmp::Ordering;

use super::explain::{gb, secs, trim_float};
use super::report::{Choice, StrategyEstimate};
use super::request::{Selection, Training};
use crate::model::Model;
use crate::strategy::Granularity;

/// Picks the strategy with the least predicted step time among those that fit; step times within
/// `time_tolerance` of it (the model's uncertainty) are a tie, which the least memory breaks, then the canonical
/// order.
pub(super) fn choose(
    estimates: &[StrategyEstimate],
    budget: u64,
    sel: &Selection,
    training: &Training,
    model: &Model,
) -> (Option<Choice>, String) {
    let fitting: Vec<&StrategyEstimate> = estimates.iter().filter(|e| e.fits).collect();
    let Some(fastest) = fitting.iter().map(|e| e.step.step_s).min_by(f64::total_cmp) else {
        return (None, no_fit_reason(estimates, budget, training, model));
    };
    let near: Vec<&StrategyEstimate> =
        fitting.iter().copied().filter(|e| e.step.step_s <= fastest * (1.0 + sel.time_tolerance)).collect();
    let Some(best) = near.iter().copied().min_by_key(|e| e.memory.total) else {
        return (None, no_fit_reason(estimates, budget, training, model));
    };
    let reason = choice_reason(best, &fitting, estimates.len(), fastest, budget, sel);
    let choice = Choice {
        strategy: best.strategy,
        code: best.code.clone(),
        known_as: best.known_as.clone(),
        reason: reason.clone(),
    };
    (Some(choice), reason)
}

fn choice_reason(
    best: &StrategyEstimate,
    fitting: &[&StrategyEstimate],
    total: usize,
    fastest: f64,
    budget: u64,
    sel: &Selection,
) -> String {
    let pct = |x: f64| format!("{}%", trim_float(x * 100.0));
    let t = &best.step;
    let interference =
        if t.interference_s > 0.0 { format!(", {} interference", secs(t.interference_s)) } else { String::new() };
    let cost = format!(
        "{} per step: {} compute, {} optimizer, {} exposed communication{interference}; {} per rank",
        secs(t.step_s),
        secs(t.compute_s),
        secs(t.optimizer_s),
        secs(t.exposed_intra_s + t.exposed_inter_s + t.exposed_global_s),
        gb(best.memory.total)
    );
    let head = if fitting.len() == 1 {
        format!("{}: the only one of the {total} strategies that fits in {} per rank ({cost})", best.code, gb(budget))
    } else if best.step.step_s <= fastest {
        format!(
            "{}: fastest of the {} strategies that fit in {} per rank ({cost})",
            best.code,
            fitting.len(),
            gb(budget)
        )
    } else {
        format!(
            "{}: within {} (the model's uncertainty) of the fastest of the {} strategies that fit in {} per rank, \
             and the lightest of those ({cost})",
            best.code,
            pct(sel.time_tolerance),
            fitting.len(),
            gb(budget)
        )
    };
    let mut others: Vec<&&StrategyEstimate> = fitting.iter().filter(|e| e.code != best.code).collect();
    others.sort_by(|a, b| a.step.step_s.total_cmp(&b.step.step_s).then(a.memory.total.cmp(&b.memory.total)));
    let mut parts = vec![head];
    for o in others.iter().take(3) {
        let speed = match o.step.step_s.total_cmp(&best.step.step_s) {
            Ordering::Equal => "is as fast".to_string(),
            Ordering::Less => format!("is {} faster", pct(1.0 - o.step.step_s / best.step.step_s)),
            Ordering::Greater => format!("is {} slower", pct(o.step.step_s / best.step.step_s - 1.0)),
        };
        let diff = gb(o.memory.total.abs_diff(best.memory.total));
        parts.push(match o.memory.total.cmp(&best.memory.total) {
            Ordering::Greater => format!("{} {speed} and needs {diff} more per rank", o.code),
            Ordering::Equal => format!("{} {speed} and needs the same memory", o.code),
            Ordering::Less => format!("{} {speed} and needs {diff} less per rank", o.code),
        });
    }
    parts.join("; ")
}

pub(super) fn no_fit_reason(estimates: &[StrategyEstimate], budget: u64, training: &Training, model: &Model) -> String {
    let Some(smallest) = estimates.iter().min_by_key(|e| e.memory.total) else {
        return "no strategy was estimated".to_string();
    };
    let m = &smallest.memory;
    let buffers = m.gathered_params + m.unsharded_grads + m.fp32_grads;
    let mut fixes = vec!["add ranks"];
    if model.shape.is_some() && m.activations > 0 {
        if !training.activation_checkpointing {
            fixes.push("turn on activation checkpointing");
        }
        fixes.push("lower the micro-batch or the sequence length");
    }
    if training.prefetch > 1 && smallest.strategy.p != Granularity::N {
        fixes.push("prefetch fewer blocks");
    }
    format!(
        "no strategy fits in {} per rank: the smallest, {}, needs {} ({} model states, {} buffers, {} activations); {}",
        gb(budget),
        smallest.code,
        gb(m.total),
        gb(m.model_states),
        gb(buffers),
        gb(m.activations),
        fixes.join(", ")
    )
}
