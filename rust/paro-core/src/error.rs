//! The one error type of the core: every message names the bad value and the fix.

/// Errors of the PaRO core. Messages carry the offending values and say what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParoError {
    /// A strategy string that is neither a 3-letter code nor a known alias.
    #[error("unknown strategy {0:?}: use a code of three letters from N/I/G for (params, grads, optimizer states), e.g. \"IIG\", or an alias: {1}")]
    UnknownStrategy(String, String),
    /// A syntactically fine triple that PaRO eliminates (os coarser than p or g).
    #[error("strategy {code} is not valid: optimizer states sharded at {os} are coarser than {what} sharded at {finer}, so every rank would update state it cannot use; {better} dominates it (same traffic or less, less memory)")]
    EliminatedStrategy { code: String, os: &'static str, what: &'static str, finer: &'static str, better: String },
    /// World size, group size or rank do not fit together.
    #[error("{0}")]
    Topology(String),
    /// A layout or plan request that cannot be satisfied.
    #[error("{0}")]
    Invalid(String),
    /// JSON in or out of the core.
    #[error("bad JSON for {what}: {msg}")]
    Json { what: &'static str, msg: String },
}

/// Result with [`ParoError`].
pub type Result<T> = std::result::Result<T, ParoError>;
