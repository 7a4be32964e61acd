//! `prices:` a price catalogue that turns a model's settled token usage
//! into money. Prices are per million tokens in the catalogue's currency,
//! so a price is also micro-units of the currency per token (2.50 USD per
//! million tokens is 2.5 micro-USD a token): a class that settles with
//! `usage: <provider>` and `price: <model>` costs the answer's tokens of
//! each kind (input, output, cached input, cache writes) at the model's
//! price for that kind, in micro-units, rounded up, and every limit it is
//! charged against counts micro-units (a budget of 500 USD is
//! 500,000,000; a limit counts up to 10¹³, ten million currency units).
//!
//! The figure is a weighted sum of the provider's usage fields (see
//! [`super::settle::Field`]): cached input tokens that a provider counts in
//! its input too (OpenAI's `cached_tokens`, Gemini's
//! `cachedContentTokenCount`) are priced by subtracting the difference;
//! fields a provider leaves out when they are zero (cached, cache writes,
//! Gemini's thinking tokens) count 0 when absent.

use std::collections::BTreeMap;

use super::error::{FieldPath, PolicyError};
use super::is_name;
use super::settle::{Field, MAX_WEIGHT, WEIGHT_SCALE};
use super::spec::UsagePreset;
use super::spec::{ModelPriceSpec, PricesSpec};

/// The compiled catalogue (empty without `prices:`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prices {
    pub version: String,
    pub currency: String,
    pub models: BTreeMap<String, ModelPrice>,
}

/// One model's prices, in thousandths of a micro-unit per token (the
/// weights of the usage fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPrice {
    pub input_milli: u64,
    pub output_milli: u64,
    /// Cached input tokens (else the input price).
    pub cached_input_milli: Option<u64>,
    /// Tokens written to a prompt cache (else the input price).
    pub cache_write_milli: Option<u64>,
}

/// Compiles `prices:`: a version, an ISO 4217 currency code, and per
/// model (named like a limit) its prices per million tokens: 0 to
/// [`MAX_WEIGHT`], at most three decimals.
pub fn compile(spec: Option<&PricesSpec>, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Prices {
    let Some(spec) = spec else {
        return Prices::default();
    };
    let printable = |s: &str| !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| (0x21..0x7f).contains(&b));
    if !printable(&spec.version) {
        errors.push(PolicyError::new(
            path.key("version"),
            "1 to 64 printable ASCII characters (the catalogue's version, in explain and the docs you keep)",
        ));
    }
    if !(spec.currency.len() == 3 && spec.currency.bytes().all(|b| b.is_ascii_uppercase())) {
        errors.push(PolicyError::new(
            path.key("currency"),
            "an ISO 4217 code: three capital letters (USD, EUR)",
        ));
    }
    if spec.models.is_empty() {
        errors.push(PolicyError::new(path.key("models"), "at least one model"));
    }
    let mut models = BTreeMap::new();
    for (name, m) in &spec.models {
        let at = path.key("models").key(name);
        if !is_name(name) {
            errors.push(PolicyError::new(
                at.clone(),
                "model names are 1 to 64 characters of A-Z a-z 0-9 _ - .",
            ));
        }
        models.insert(name.clone(), compile_model(m, &at, errors));
    }
    Prices {
        version: spec.version.clone(),
        currency: spec.currency.clone(),
        models,
    }
}

/// One model's prices (a price with an error, reported, counts 0: the
/// policy is refused anyway, and the model stays known to its classes).
fn compile_model(m: &ModelPriceSpec, at: &FieldPath, errors: &mut Vec<PolicyError>) -> ModelPrice {
    let mut price = |field: &str, value: f64| -> u64 {
        let milli = value * WEIGHT_SCALE as f64;
        if !(0.0..=MAX_WEIGHT).contains(&value) || (milli - milli.round()).abs() > 1e-6 {
            errors.push(PolicyError::new(
                at.key(field),
                format!("a price per million tokens from 0 to {MAX_WEIGHT}, with at most three decimals"),
            ));
            return 0;
        }
        milli.round() as u64
    };
    ModelPrice {
        input_milli: price("input", m.input),
        output_milli: price("output", m.output),
        cached_input_milli: m.cached_input.map(|p| price("cached_input", p)),
        cache_write_milli: m.cache_write.map(|p| price("cache_write", p)),
    }
}

impl ModelPrice {
    /// The usage fields of `provider`'s answers (JSON, or its stream's
    /// events), each at this model's price for its kind of token: the
    /// figure is the answer's cost in micro-units.
    pub fn fields(&self, provider: UsagePreset) -> Vec<Field> {
        let field = |name: &str, pointers: &[&[&str]], weight_milli: u64, optional: bool| Field {
            name: name.to_owned(),
            pointers: pointers
                .iter()
                .map(|p| p.iter().map(|s| (*s).to_owned()).collect())
                .collect(),
            weight_milli,
            negative: false,
            optional,
        };
        // Cached tokens a provider also counts as input: priced by the
        // difference to the input price, added or subtracted.
        let included_cached = |name: &str, pointers: &[&[&str]]| {
            self.cached_input_milli.map(|cached| {
                let mut f = field(name, pointers, cached.abs_diff(self.input_milli), true);
                f.negative = cached < self.input_milli;
                f
            })
        };
        let cached = self.cached_input_milli.unwrap_or(self.input_milli);
        let write = self.cache_write_milli.unwrap_or(self.input_milli);
        match provider {
            UsagePreset::OpenaiTotal | UsagePreset::OpenaiPrompt | UsagePreset::OpenaiCompletion => {
                let mut out = vec![
                    field(
                        "input /usage/prompt_tokens",
                        &[
                            &["usage", "prompt_tokens"],
                            &["usage", "input_tokens"],
                            &["response", "usage", "input_tokens"],
                        ],
                        self.input_milli,
                        false,
                    ),
                    field(
                        "output /usage/completion_tokens",
                        &[
                            &["usage", "completion_tokens"],
                            &["usage", "output_tokens"],
                            &["response", "usage", "output_tokens"],
                        ],
                        self.output_milli,
                        false,
                    ),
                ];
                out.extend(included_cached(
                    "cached input /usage/prompt_tokens_details/cached_tokens",
                    &[
                        &["usage", "prompt_tokens_details", "cached_tokens"],
                        &["usage", "input_tokens_details", "cached_tokens"],
                        &["response", "usage", "input_tokens_details", "cached_tokens"],
                    ],
                ));
                out
            }
            UsagePreset::Anthropic => vec![
                field(
                    "input /usage/input_tokens",
                    &[&["usage", "input_tokens"], &["message", "usage", "input_tokens"]],
                    self.input_milli,
                    false,
                ),
                field(
                    "output /usage/output_tokens",
                    &[
                        &["usage", "output_tokens"],
                        &["message", "usage", "output_tokens"],
                    ],
                    self.output_milli,
                    false,
                ),
                field(
                    "cached input /usage/cache_read_input_tokens",
                    &[
                        &["usage", "cache_read_input_tokens"],
                        &["message", "usage", "cache_read_input_tokens"],
                    ],
                    cached,
                    true,
                ),
                field(
                    "cache writes /usage/cache_creation_input_tokens",
                    &[
                        &["usage", "cache_creation_input_tokens"],
                        &["message", "usage", "cache_creation_input_tokens"],
                    ],
                    write,
                    true,
                ),
            ],
            UsagePreset::Gemini => {
                let mut out = vec![
                    field(
                        "input /usageMetadata/promptTokenCount",
                        &[&["usageMetadata", "promptTokenCount"]],
                        self.input_milli,
                        false,
                    ),
                    field(
                        "output /usageMetadata/candidatesTokenCount",
                        &[&["usageMetadata", "candidatesTokenCount"]],
                        self.output_milli,
                        true,
                    ),
                    field(
                        "thinking /usageMetadata/thoughtsTokenCount",
                        &[&["usageMetadata", "thoughtsTokenCount"]],
                        self.output_milli,
                        true,
                    ),
                ];
                out.extend(included_cached(
                    "cached input /usageMetadata/cachedContentTokenCount",
                    &[&["usageMetadata", "cachedContentTokenCount"]],
                ));
                out
            }
            UsagePreset::Bedrock => vec![
                field(
                    "input /usage/inputTokens",
                    &[&["usage", "inputTokens"], &["metadata", "usage", "inputTokens"]],
                    self.input_milli,
                    false,
                ),
                field(
                    "output /usage/outputTokens",
                    &[&["usage", "outputTokens"], &["metadata", "usage", "outputTokens"]],
                    self.output_milli,
                    false,
                ),
                field(
                    "cached input /usage/cacheReadInputTokens",
                    &[
                        &["usage", "cacheReadInputTokens"],
                        &["metadata", "usage", "cacheReadInputTokens"],
                    ],
                    cached,
                    true,
                ),
                field(
                    "cache writes /usage/cacheWriteInputTokens",
                    &[
                        &["usage", "cacheWriteInputTokens"],
                        &["metadata", "usage", "cacheWriteInputTokens"],
                    ],
                    write,
                    true,
                ),
            ],
        }
    }
}
