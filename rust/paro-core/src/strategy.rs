//! Strategy algebra: (p, g, os) ∈ {N, I, G}³, valid iff os is at least as fine as p and g (14 of 27).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};

/// How finely one kind of model state is sharded. Ordered coarse to fine: N < I < G.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Granularity {
    /// Not sharded: every rank holds the whole tensor.
    N,
    /// Sharded inside a group of fast-linked ranks, replicated across groups.
    I,
    /// Sharded across all ranks of the world.
    G,
}

impl Granularity {
    /// All three, coarse to fine.
    pub const ALL: [Granularity; 3] = [Granularity::N, Granularity::I, Granularity::G];

    /// The letter used in strategy codes.
    pub fn letter(self) -> char {
        match self {
            Granularity::N => 'N',
            Granularity::I => 'I',
            Granularity::G => 'G',
        }
    }

    /// Parses one letter (any case).
    pub fn from_letter(c: char) -> Option<Self> {
        match c.to_ascii_uppercase() {
            'N' => Some(Granularity::N),
            'I' => Some(Granularity::I),
            'G' => Some(Granularity::G),
            _ => None,
        }
    }

    /// Words for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            Granularity::N => "N (not sharded)",
            Granularity::I => "I (inside a group)",
            Granularity::G => "G (across the world)",
        }
    }

    /// Number of shards a tensor is cut into at this granularity: 1, the group size m, or the world size n.
    pub fn degree(self, group_size: usize, world: usize) -> usize {
        match self {
            Granularity::N => 1,
            Granularity::I => group_size,
            Granularity::G => world,
        }
    }
}

/// Well-known names for strategies, as users of DDP, DeepSpeed and FSDP know them.
pub const ALIASES: &[(&str, &str)] = &[
    ("ddp", "NNN"),
    ("zero1", "NNG"),
    ("zero2", "NGG"),
    ("zero3", "GGG"),
    ("fsdp", "GGG"),
    ("full_shard", "GGG"),
    ("mics", "III"),
    ("hsdp", "III"),
    ("hybrid_shard", "III"),
    ("hsdp_zero2", "NII"),
];

/// A PaRO-DP strategy: the sharding granularity of parameters (p), gradients (g) and optimizer states (os).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Strategy {
    /// Parameters.
    pub p: Granularity,
    /// Gradients.
    pub g: Granularity,
    /// Optimizer states.
    pub os: Granularity,
}

impl Strategy {
    /// Builds a strategy, rejecting the 13 eliminated triples with the reason and the dominating strategy.
    pub fn new(p: Granularity, g: Granularity, os: Granularity) -> Result<Self> {
        let s = Strategy { p, g, os };
        if os >= p && os >= g {
            return Ok(s);
        }
        let (what, finer) = if p > os && p >= g { ("parameters", p) } else { ("gradients", g) };
        let better = Strategy { p, g, os: p.max(g) };
        Err(ParoError::EliminatedStrategy {
            code: s.code(),
            os: os.describe(),
            what,
            finer: finer.describe(),
            better: better.code(),
        })
    }

    /// Parses "IIG", "iig", "PaRO-IIG", "PIIG" or an alias such as "zero3" or "hsdp".
    pub fn parse(text: &str) -> Result<Self> {
        let t = text.trim();
        let lower = t.to_ascii_lowercase();
        if let Some((_, code)) = ALIASES.iter().find(|(a, _)| *a == lower) {
            return Strategy::parse(code);
        }
        let body = lower.strip_prefix("paro-").or_else(|| lower.strip_prefix("paro_")).unwrap_or(&lower);
        let body = if body.len() == 4 && body.starts_with('p') { &body[1..] } else { body };
        let letters: Vec<Granularity> = body.chars().filter_map(Granularity::from_letter).collect();
        if body.chars().count() != 3 || letters.len() != 3 {
            let aliases: Vec<String> = ALIASES.iter().map(|(a, c)| format!("{a}={c}")).collect();
            return Err(ParoError::UnknownStrategy(text.to_string(), aliases.join(", ")));
        }
        Strategy::new(letters[0], letters[1], letters[2])
    }

    /// The three-letter code, e.g. "IIG".
    pub fn code(&self) -> String {
        [self.p, self.g, self.os].iter().map(|g| g.letter()).collect()
    }

    /// The well-known name of this strategy, if it has one (first alias wins).
    pub fn known_as(&self) -> Option<&'static str> {
        let code = self.code();
        ALIASES.iter().find(|(_, c)| *c == code).map(|(a, _)| *a)
    }

    /// The 14 valid strategies, in a fixed order (p, then g, then os, coarse to fine).
    pub fn all_valid() -> Vec<Strategy> {
        Self::all_triples().into_iter().filter_map(|(p, g, os)| Strategy::new(p, g, os).ok()).collect()
    }

    /// All 27 triples, valid or not.
    pub fn all_triples() -> Vec<(Granularity, Granularity, Granularity)> {
        let mut out = Vec::with_capacity(27);
        for p in Granularity::ALL {
            for g in Granularity::ALL {
                for os in Granularity::ALL {
                    out.push((p, g, os));
                }
            }
        }
        out
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_fourteen_valid() {
        let codes: Vec<String> = Strategy::all_valid().iter().map(Strategy::code).collect();
        let expected =
            ["NNN", "NNI", "NNG", "NII", "NIG", "NGG", "INI", "ING", "III", "IIG", "IGG", "GNG", "GIG", "GGG"];
        assert_eq!(codes, expected);
    }

    #[test]
    fn the_thirteen_eliminated() {
        let bad: Vec<String> = Strategy::all_triples()
            .into_iter()
            .filter(|&(p, g, os)| Strategy::new(p, g, os).is_err())
            .map(|(p, g, os)| [p, g, os].iter().map(|x| x.letter()).collect())
            .collect();
        let mut expected =
            vec!["NIN", "NGN", "INN", "IIN", "IGN", "GNN", "GIN", "GGN", "NGI", "IGI", "GNI", "GII", "GGI"];
        expected.sort();
        let mut got = bad.clone();
        got.sort();
        assert_eq!(got, expected);
    }

    #[test]
    fn parse_codes_and_aliases() {
        for (s, code) in [
            ("IIG", "IIG"),
            ("iig", "IIG"),
            ("PaRO-IIG", "IIG"),
            ("PIIG", "IIG"),
            (" ing ", "ING"),
            ("ddp", "NNN"),
            ("ZeRO1", "NNG"),
            ("zero2", "NGG"),
            ("zero3", "GGG"),
            ("fsdp", "GGG"),
            ("mics", "III"),
            ("HSDP", "III"),
            ("hsdp_zero2", "NII"),
        ] {
            assert_eq!(Strategy::parse(s).unwrap().code(), code, "{s}");
        }
    }

    #[test]
    fn eliminated_names_the_dominating_strategy() {
        let err = Strategy::parse("INN").unwrap_err().to_string();
        assert!(err.contains("INN is not valid"), "{err}");
        assert!(err.contains("INI dominates"), "{err}");
        let err = Strategy::parse("GGI").unwrap_err().to_string();
        assert!(err.contains("GGG dominates"), "{err}");
        let err = Strategy::parse("NGN").unwrap_err().to_string();
        assert!(err.contains("gradients"), "{err}");
    }

    #[test]
    fn unknown_lists_aliases() {
        let err = Strategy::parse("zero4").unwrap_err().to_string();
        assert!(err.contains("zero4") && err.contains("zero3=GGG"), "{err}");
        assert!(Strategy::parse("IIX").is_err());
        assert!(Strategy::parse("IIGG").is_err());
        assert!(Strategy::parse("").is_err());
    }
}
