//! paro-core: the arithmetic of PaRO (arXiv 2310.06003), free of torch, pyo3 and C++.
//!
//! Vocabulary: a *group* is a set of m fast-linked ranks (granularity I, "intra"); the *world* is all n
//! ranks (granularity G); *inter* traffic runs between groups among ranks of equal local rank (a rail).
//! `p`, `g`, `os` name the parameters, gradients and optimizer states.

pub mod comm;
pub mod cost;
pub mod error;
pub mod host;
pub mod layout;
pub mod model;
pub mod planner;
pub mod strategy;
pub mod streams;
pub mod topology;

pub use comm::{Collective, Level};
pub use error::{ParoError, Result};
pub use strategy::{Granularity, Strategy};
pub use topology::Topology;
