//! Model shapes: a model is the list of blocks the engine wraps (one communication unit each, with a
//! trainable and a frozen flat buffer), given directly, from a LLaMA-style shape or preset, or from a count.

use serde::{Deserialize, Serialize};

use crate::error::{ParoError, Result};

/// One wrapped block: one communication unit with a trainable and a frozen flat buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Block {
    /// Number of parameters in the block (trainable and frozen).
    pub numel: u64,
    /// How many of them are trainable (at most `numel`); the rest are frozen.
    pub trainable: u64,
    /// The engine's padded buffer sizes, when it knows the parameters' shapes (see `layout::RowLayout`);
    /// without them each buffer counts as padded to a multiple of the world size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padded: Option<Padded>,
}

/// Padded element counts of a block's trainable and frozen buffers laid out at N, I and G (in that order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Padded {
    /// The trainable buffer at N, I, G.
    pub trainable: [u64; 3],
    /// The frozen buffer at N, I, G.
    pub frozen: [u64; 3],
}

impl Block {
    /// Number of frozen parameters, `numel - trainable`.
    pub fn frozen(&self) -> u64 {
        self.numel.saturating_sub(self.trainable)
    }
}

/// A LLaMA-style decoder-only transformer, in the field names of a Hugging Face `config.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaShape {
    /// Model width h.
    pub hidden_size: u64,
    /// Number of decoder layers L.
    pub num_hidden_layers: u64,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: u64,
    /// Vocabulary size V.
    pub vocab_size: u64,
    /// Number of attention (query) heads a.
    pub num_attention_heads: u64,
    /// Number of key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<u64>,
    /// Whether the LM head shares the embedding matrix (then the last block holds only the final norm).
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// Names accepted by [`LlamaShape::preset`].
pub const PRESETS: &[&str] = &["llama-7b", "llama-13b", "llama-30b", "llama-65b"];

/// Multiplies two counts, failing instead of overflowing.
pub(crate) fn checked_mul(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_mul(b).ok_or_else(|| too_large(what))
}

/// Adds two counts, failing instead of overflowing.
pub(crate) fn checked_add(a: u64, b: u64, what: &str) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| too_large(what))
}

fn too_large(what: &str) -> ParoError {
    ParoError::Invalid(format!(
        "{what} does not fit in 64 bits; check the sizes in the request (counts are elements, sizes are bytes)"
    ))
}

impl LlamaShape {
    /// The LLaMA-1 shape of a preset: llama-7b, llama-13b, llama-30b or llama-65b (case and `_`/`-` ignored).
    pub fn preset(name: &str) -> Result<Self> {
        let key = name.trim().to_ascii_lowercase().replace('_', "-");
        let key = key.strip_prefix("llama-").unwrap_or(&key);
        let (hidden_size, num_hidden_layers, intermediate_size, num_attention_heads) = match key {
            "7b" => (4096, 32, 11008, 32),
            "13b" => (5120, 40, 13824, 40),
            "30b" | "33b" => (6656, 60, 17920, 52),
            "65b" => (8192, 80, 22016, 64),
            _ => {
                return Err(ParoError::Invalid(format!(
                    "unknown model preset {name:?}; use one of {}, or give a shape or a parameter count",
                    PRESETS.join(", ")
                )))
            }
        };
        Ok(LlamaShape {
            hidden_size,
            num_hidden_layers,
            intermediate_size,
            vocab_size: 32000,
            num_attention_heads,
            num_key_value_heads: None,
            tie_word_embeddings: false,
        })
    }

    /// Number of key/value heads, defaulting to the number of attention heads.
    pub fn kv_heads(&self) -> u64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Checks that every size is positive and that the heads divide the width.
    pub fn validate(&self) -> Result<()> {
        for (name, value) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
        ] {
            if value == 0 {
                return Err(ParoError::Invalid(format!("model shape: {name} must be at least 1")));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(ParoError::Invalid(format!(
                "model shape: hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            )));
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(ParoError::Invalid(format!(
                "model shape: num_attention_heads {} is not divisible by num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            )));
        }
        Ok(())
    }

    /// Parameters per block: the embedding, each decoder layer, then the final norm with the LM head.
    ///
    /// A layer is q, k, v, o projections (k and v of width kv_heads·head_dim), the gate, up and down
    /// projections of the MLP and two RMSNorm weights; there are no biases.
    pub fn block_numels(&self) -> Result<Vec<u64>> {
        self.validate()?;
        let h = self.hidden_size;
        let what = "the parameter count of the model shape";
        let head_dim = h / self.num_attention_heads;
        let kv_width = checked_mul(self.kv_heads(), head_dim, what)?;
        let embedding = checked_mul(self.vocab_size, h, what)?;
        let attention = checked_add(
            checked_mul(2, checked_mul(h, h, what)?, what)?,
            checked_mul(2, checked_mul(h, kv_width, what)?, what)?,
            what,
        )?;
        let mlp = checked_mul(3, checked_mul(h, self.intermediate_size, what)?, what)?;
        let layer = checked_add(checked_add(attention, mlp, what)?, checked_mul(2, h, what)?, what)?;
        let last = if self.tie_word_embeddings { h } else { checked_add(h, embedding, what)? };
        let layers = usize::try_from(self.num_hidden_layers).ok().filter(|&l| l <= 1_000_000).ok_or_else(|| {
            ParoError::Invalid(format!(
                "model shape: num_hidden_layers {} is too large (at most 1000000)",
                self.num_hidden_layers
            ))
        })?;
        let mut blocks = vec![layer; layers + 2];
        blocks[0] = embedding;
        blocks[layers + 1] = last;
        blocks.iter().try_fold(0u64, |acc, &b| checked_add(acc, b, what))?;
        Ok(blocks)
    }

    /// Total number of parameters.
    pub fn num_params(&self) -> Result<u64> {
        self.block_numels()?.iter().try_fold(0u64, |acc, &b| checked_add(acc, b, "the parameter count"))
    }

    /// Activation memory per rank in bytes (16-bit activations), after Korthikanti et al. 2022,
    /// "Reducing Activation Recomputation in Large Transformer Models", §4.
    ///
    /// One layer without recomputation stores s·b·h·(34 + 5·a·s/h) bytes (s sequence length, b micro-batch,
    /// h width, a heads; 5·a·s²·b is the attention score/softmax/dropout part). With full activation
    /// checkpointing each layer keeps only its 2·s·b·h-byte input, and one layer is recomputed at a time:
    /// 2·s·b·h·L + s·b·h·(34 + 5·a·s/h). Without it: L·s·b·h·(34 + 5·a·s/h). The formula is for a GPT layer
    /// with a 4h GeLU MLP and dropout; it is used as is for LLaMA (SwiGLU, no dropout, often flash
    /// attention), which makes it a slight over-estimate. Logits and the loss are not counted.
    pub fn activation_bytes(&self, micro_batch: u64, seq_len: u64, checkpointing: bool) -> Result<u64> {
        self.validate()?;
        let what = "the activation estimate";
        let sbh = checked_mul(checked_mul(seq_len, micro_batch, what)?, self.hidden_size, what)?;
        let scores = checked_mul(
            checked_mul(checked_mul(5, self.num_attention_heads, what)?, seq_len, what)?,
            checked_mul(seq_len, micro_batch, what)?,
            what,
        )?;
        let one_layer = checked_add(checked_mul(34, sbh, what)?, scores, what)?;
        if checkpointing {
            let inputs = checked_mul(checked_mul(2, sbh, what)?, self.num_hidden_layers, what)?;
            checked_add(inputs, one_layer, what)
        } else {
            checked_mul(one_layer, self.num_hidden_layers, what)
        }
    }
}

/// How many parameters are trainable, when the model does not list its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Trainable {
    /// A fraction in [0, 1] of all parameters: Ψ' = round(fraction·Ψ).
    Fraction(f64),
    /// An exact count of trainable parameters, at most Ψ.
    Count(u64),
}

/// The model of a request: exactly one of `preset`, `shape`, `params` or `blocks`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A LLaMA-1 preset name: llama-7b, llama-13b, llama-30b or llama-65b.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preset: Option<String>,
    /// A LLaMA-style shape (Hugging Face `config.json` field names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<LlamaShape>,
    /// A bare parameter count Ψ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<u64>,
    /// How many equal blocks a bare `params` count is cut into; without it the block sizes are unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_blocks: Option<u64>,
    /// The exact blocks the engine wraps, each with its own trainable count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<Block>>,
}

/// A model resolved to blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The blocks, in execution order.
    pub blocks: Vec<Block>,
    /// The shape, when known (needed for the activation estimate).
    pub shape: Option<LlamaShape>,
    /// Whether the block sizes are real (false for a bare count without `num_blocks`).
    pub blocks_known: bool,
}

impl Model {
    /// Total parameters Ψ.
    pub fn num_params(&self) -> u64 {
        self.blocks.iter().map(|b| b.numel).sum()
    }

    /// Trainable parameters Ψ'.
    pub fn num_trainable(&self) -> u64 {
        self.blocks.iter().map(|b| b.trainable).sum()
    }
}

/// Most blocks a request may have.
pub const MAX_BLOCKS: u64 = 1_000_000;

impl ModelSpec {
    /// Expands the spec to blocks, giving them `trainable` in proportion to their size (all trainable if `None`).
    pub fn resolve(&self, trainable: Option<Trainable>) -> Result<Model> {
        let given: Vec<&str> = [
            ("preset", self.preset.is_some()),
            ("shape", self.shape.is_some()),
            ("params", self.params.is_some()),
            ("blocks", self.blocks.is_some()),
        ]
        .iter()
        .filter(|(_, set)| *set)
        .map(|(name, _)| *name)
        .collect();
        if given.len() != 1 {
            return Err(ParoError::Invalid(format!(
                "the model must be given by exactly one of preset, shape, params or blocks (got {})",
                if given.is_empty() { "none".to_string() } else { given.join(" and ") }
            )));
        }
        if self.num_blocks.is_some() && self.params.is_none() {
            return Err(ParoError::Invalid("num_blocks only applies to a bare params count".into()));
        }
        if let Some(blocks) = &self.blocks {
            if trainable.is_some() {
                return Err(ParoError::Invalid(
                    "the blocks already say how many parameters are trainable; drop the separate trainable".into(),
                ));
            }
            return resolve_blocks(blocks);
        }
        let (numels, shape, blocks_known) = if let Some(name) = &self.preset {
            let shape = LlamaShape::preset(name)?;
            (shape.block_numels()?, Some(shape), true)
        } else if let Some(shape) = &self.shape {
            (shape.block_numels()?, Some(shape.clone()), true)
        } else {
            let params = self.params.unwrap_or(0);
            if params == 0 {
                return Err(ParoError::Invalid("params must be at least 1".into()));
            }
            let count = self.num_blocks.unwrap_or(1);
            if count == 0 || count > MAX_BLOCKS || count > params {
                return Err(ParoError::Invalid(format!(
                    "num_blocks {count} must be between 1 and min(params, {MAX_BLOCKS})"
                )));
            }
            let ones = vec![1u64; count as usize];
            (distribute(&ones, params)?, None, self.num_blocks.is_some())
        };
        let total: u64 = numels.iter().sum();
        let total_trainable = match trainable {
            None => total,
            Some(Trainable::Count(c)) => {
                if c > total {
                    return Err(ParoError::Invalid(format!(
                        "trainable count {c} exceeds the {total} parameters of the model"
                    )));
                }
                c
            }
            Some(Trainable::Fraction(f)) => {
                if !f.is_finite() || !(0.0..=1.0).contains(&f) {
                    return Err(ParoError::Invalid(format!(
                        "trainable fraction {f} must be between 0 and 1; pass a count for an absolute number"
                    )));
                }
                // f·Ψ ≤ Ψ < 2^64, so the cast is in range; `min` guards rounding at the top.
                ((f * total as f64).round() as u64).min(total)
            }
        };
        let shares = distribute(&numels, total_trainable)?;
        let blocks =
            numels.iter().zip(shares).map(|(&numel, trainable)| Block { numel, trainable, padded: None }).collect();
        Ok(Model { blocks, shape, blocks_known })
    }
}

fn resolve_blocks(blocks: &[Block]) -> Result<Model> {
    if blocks.is_empty() {
        return Err(ParoError::Invalid("blocks must not be empty".into()));
    }
    if blocks.len() as u64 > MAX_BLOCKS {
        return Err(ParoError::Invalid(format!("{} blocks are too many (at most {MAX_BLOCKS})", blocks.len())));
    }
    let mut total = 0u64;
    for (i, b) in blocks.iter().enumerate() {
        if b.numel == 0 {
            return Err(ParoError::Invalid(format!("block {i} has no parameters; drop it")));
        }
        if b.trainable > b.numel {
            return Err(ParoError::Invalid(format!(
                "block {i} has {} trainable parameters but only {} in all",
                b.trainable, b.numel
            )));
        }
        total = checked_add(total, b.numel, "the parameter count")?;
    }
    Ok(Model { blocks: blocks.to_vec(), shape: None, blocks_known: true })
}

/// Splits `total` over parts in proportion to `weights` (largest remainder, ties to the earlier part), so
/// that the shares sum to `total` exactly and each share is at most its weight when `total ≤ Σ weights`.
pub fn distribute(weights: &[u64], total: u64) -> Result<Vec<u64>> {
    let sum: u128 = weights.iter().map(|&w| w as u128).sum();
    if sum == 0 {
        return if total == 0 {
            Ok(vec![0; weights.len()])
        } else {
            Err(ParoError::Invalid(format!("cannot split {total} over parts that are all empty")))
        };
    }
    let mut shares = Vec::with_capacity(weights.len());
    let mut remainders = Vec::with_capacity(weights.len());
    let mut assigned: u128 = 0;
    for (i, &w) in weights.iter().enumerate() {
        // w·total < 2^128, so this is exact.
        let exact = w as u128 * total as u128;
        let share = exact / sum;
        assigned += share;
        shares.push(share as u64);
        remainders.push((exact % sum, i));
    }
    let left = (total as u128 - assigned) as usize;
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(left) {
        shares[i] += 1;
    }
    Ok(shares)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_llama1_sizes() {
        // Known totals of the released LLaMA-1 checkpoints.
        for (name, params) in [
            ("llama-7b", 6_738_415_616u64),
            ("llama-13b", 13_015_864_320),
            ("llama-30b", 32_528_943_616),
            ("llama-65b", 65_285_660_672),
        ] {
            let shape = LlamaShape::preset(name).unwrap();
            assert_eq!(shape.num_params().unwrap(), params, "{name}");
        }
        let blocks = LlamaShape::preset("LLaMA_7B").unwrap().block_numels().unwrap();
        assert_eq!(blocks.len(), 34);
        assert_eq!(blocks[0], 32000 * 4096);
        assert_eq!(blocks[1], 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096);
        assert_eq!(blocks[33], 4096 + 32000 * 4096);
        assert!(LlamaShape::preset("llama-8b").unwrap_err().to_string().contains("llama-65b"));
    }

    #[test]
    fn grouped_query_attention_and_tied_embeddings() {
        let shape = LlamaShape {
            hidden_size: 64,
            num_hidden_layers: 2,
            intermediate_size: 128,
            vocab_size: 100,
            num_attention_heads: 8,
            num_key_value_heads: Some(2),
            tie_word_embeddings: true,
        };
        // head_dim 8, kv width 16: q,o 64·64 each, k,v 64·16 each, MLP 3·64·128, norms 2·64.
        let layer = 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128 + 2 * 64;
        assert_eq!(shape.block_numels().unwrap(), vec![6400, layer, layer, 64]);
        let bad = LlamaShape { num_key_value_heads: Some(3), ..shape.clone() };
        assert!(bad.validate().unwrap_err().to_string().contains("num_key_value_heads 3"));
        let bad = LlamaShape { hidden_size: 0, ..shape };
        assert!(bad.block_numels().is_err());
    }

    #[test]
    fn activations_follow_korthikanti() {
        let shape = LlamaShape::preset("llama-7b").unwrap();
        let (s, b, h, a, l) = (2048u64, 1u64, 4096u64, 32u64, 32u64);
        let layer = s * b * h * 34 + 5 * a * s * s * b;
        assert_eq!(shape.activation_bytes(b, s, false).unwrap(), l * layer);
        assert_eq!(shape.activation_bytes(b, s, true).unwrap(), 2 * s * b * h * l + layer);
        assert!(shape.activation_bytes(u64::MAX, s, true).is_err());
    }

    #[test]
    fn distribute_is_exact_and_proportional() {
        assert_eq!(distribute(&[1, 1, 1], 10).unwrap(), vec![4, 3, 3]);
        assert_eq!(distribute(&[10, 30], 4).unwrap(), vec![1, 3]);
        assert_eq!(distribute(&[5, 0, 5], 0).unwrap(), vec![0, 0, 0]);
        assert_eq!(
            distribute(&[u64::MAX, u64::MAX], u64::MAX).unwrap().iter().map(|&x| x as u128).sum::<u128>(),
            u64::MAX as u128
        );
        assert!(distribute(&[0, 0], 1).is_err());
        let w = [7u64, 13, 1, 99];
        for total in 0..=120 {
            let s = distribute(&w, total).unwrap();
            assert_eq!(s.iter().sum::<u64>(), total);
            assert!(s.iter().zip(w).all(|(&x, w)| x <= w));
        }
    }

    #[test]
    fn resolve_forms() {
        let m =
            ModelSpec { params: Some(1000), ..Default::default() }.resolve(Some(Trainable::Fraction(0.003))).unwrap();
        assert_eq!(m.blocks, vec![Block { numel: 1000, trainable: 3, padded: None }]);
        assert!(!m.blocks_known);
        let m = ModelSpec { params: Some(10), num_blocks: Some(3), ..Default::default() }
            .resolve(Some(Trainable::Count(4)))
            .unwrap();
        assert_eq!(m.blocks.iter().map(|b| b.numel).collect::<Vec<_>>(), vec![4, 3, 3]);
        assert_eq!(m.num_trainable(), 4);
        assert!(m.blocks_known);
        let m = ModelSpec { preset: Some("llama-65b".into()), ..Default::default() }
            .resolve(Some(Trainable::Fraction(1.0 / 16.0)))
            .unwrap();
        assert_eq!(m.num_trainable(), (m.num_params() as f64 / 16.0).round() as u64);
        assert!(m.shape.is_some());
    }

    #[test]
    fn resolve_errors() {
        let none = ModelSpec::default().resolve(None).unwrap_err().to_string();
        assert!(none.contains("exactly one"), "{none}");
        let two = ModelSpec { preset: Some("llama-7b".into()), params: Some(5), ..Default::default() };
        assert!(two.resolve(None).unwrap_err().to_string().contains("preset and params"));
        let p = ModelSpec { params: Some(100), ..Default::default() };
        assert!(p.resolve(Some(Trainable::Fraction(1.5))).is_err());
        assert!(p.resolve(Some(Trainable::Fraction(f64::NAN))).is_err());
        assert!(p.resolve(Some(Trainable::Count(101))).is_err());
        let zero = ModelSpec { params: Some(0), ..Default::default() };
        assert!(zero.resolve(None).is_err());
        let blocks = |b: Vec<Block>| ModelSpec { blocks: Some(b), ..Default::default() };
        assert!(blocks(vec![]).resolve(None).is_err());
        assert!(blocks(vec![Block { numel: 0, trainable: 0, padded: None }]).resolve(None).is_err());
        assert!(blocks(vec![Block { numel: 2, trainable: 3, padded: None }]).resolve(None).is_err());
        assert!(blocks(vec![Block { numel: 2, trainable: 1, padded: None }])
            .resolve(Some(Trainable::Count(1)))
            .is_err());
        assert!(blocks(vec![
            Block { numel: u64::MAX, trainable: 0, padded: None },
            Block { numel: 1, trainable: 0, padded: None }
        ])
        .resolve(None)
        .is_err());
    }
}
