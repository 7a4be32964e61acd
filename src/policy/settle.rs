//! Costs known only after the response, in the policy: a route class's
//! `settle:` block (where the real cost comes from, its ceiling, what a
//! stream without a usable figure costs, where the estimate comes from),
//! validated and compiled; every default of these fields is here, once.
//! How the filter reads and settles them is in [`crate::cost`].

use super::error::{FieldPath, PolicyError};
use super::spec::{
    Charge, FieldSpec, OnMissing, OutcomeSpec, OverReservation, RouteSpec, SettleSpec, UsagePreset,
};
use super::values::{is_header_name, MAX_COUNT};

/// Default and largest `settle.max_body_bytes`: the response body bytes
/// read for the figure (a longer body settles by `on_missing`).
pub const DEFAULT_SETTLE_MAX_BODY_BYTES: u64 = 1 << 20;
pub const MAX_SETTLE_MAX_BODY_BYTES: i64 = 16 << 20;
/// Most `settle.fields`.
pub const MAX_FIELDS: usize = 4;
/// Most segments of a field's JSON pointer, and bytes of one segment.
pub const MAX_POINTER_SEGMENTS: usize = 8;
pub const MAX_SEGMENT_LEN: usize = 64;
/// A field's weight is kept in thousandths: at most three decimals, in
/// `(0, MAX_WEIGHT]`.
pub const WEIGHT_SCALE: u64 = 1000;
pub const MAX_WEIGHT: f64 = 1000.0;

/// Most `settle.methods` and `settle.paths`, and bytes of a path prefix.
pub const MAX_MATCHES: usize = 16;
pub const MAX_PATH_PREFIX: usize = 256;

/// A compiled `routes.<class>.settle`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settle {
    pub source: Source,
    /// `price:` the catalogue's model the source's usage is priced at
    /// (the figure is then in micro-units of the catalogue's currency).
    pub price: Option<String>,
    /// No response costs more (a larger figure is cut to it and counted).
    pub ceiling: u64,
    pub on_missing: OnMissing,
    /// Response body bytes read for the figure (body sources only).
    pub max_body_bytes: u64,
    pub estimate: Estimate,
    /// The metered operation: these methods (upper-case) ...
    pub methods: Vec<String>,
    /// ... on these path prefixes (empty: every path).
    pub paths: Vec<String>,
    pub outcomes: Outcomes,
    /// Units reserved at a time when a stream's running cost passes its
    /// reservation (`settle.chunk`; default [`default_chunk`]).
    pub chunk: u64,
    pub over_reservation: OverReservation,
    /// An event stream the filter ends early gets its provider's terminal
    /// event (false for formats whose stream has none: Gemini, Bedrock; a
    /// Gemini JSON-array stream gets its closing `]` whatever this says).
    pub terminal_event: bool,
    /// Ask a streamed request's upstream for its usage
    /// (`stream_options.include_usage`: [`crate::cost::rewrite`]).
    pub include_usage: bool,
    /// The input estimate: one unit per this many bytes of the request's
    /// declared `content-length`, added to the estimate (`None`: none).
    pub input_bytes_per_token: Option<u64>,
}

/// Divides the ceiling into the default `settle.chunk`.
pub const DEFAULT_CHUNKS_PER_CEILING: u64 = 16;

/// The default `settle.chunk`: a sixteenth of the ceiling, rounded up
/// (a stream far over its estimate reserves 16 times at most).
pub fn default_chunk(ceiling: u64) -> u64 {
    ceiling.div_ceil(DEFAULT_CHUNKS_PER_CEILING).max(1)
}

/// What an answer that is not the operation's success costs, by outcome
/// (`settle.on_outcome`; the defaults never lock an honest tenant out over
/// errors it did not cause: see [`Outcomes::default`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcomes {
    pub upstream_5xx: Charge,
    pub upstream_4xx: Charge,
    pub local_reply: Charge,
    pub no_response: Charge,
}

impl Default for Outcomes {
    /// Errors cost nothing (no tokens were served: a tenant is never
    /// locked out by an upstream's or Envoy's failures); a stream that
    /// ended before any response header keeps its estimate (the upstream
    /// may have started on it, and the client chose to leave).
    fn default() -> Outcomes {
        Outcomes {
            upstream_5xx: Charge::Nothing,
            upstream_4xx: Charge::Nothing,
            local_reply: Charge::Nothing,
            no_response: Charge::Estimate,
        }
    }
}

impl Charge {
    pub fn as_str(self) -> &'static str {
        match self {
            Charge::Nothing => "nothing",
            Charge::Estimate => "estimate",
            Charge::Ceiling => "ceiling",
        }
    }
}

/// The default metered methods.
pub const DEFAULT_METHODS: [&str; 1] = ["POST"];

/// Where the real cost comes from: always the upstream's response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A response header (lower-cased).
    Header(String),
    /// A response trailer (lower-cased).
    Trailer(String),
    /// Fields of the JSON body, or of each event of a `text/event-stream`
    /// body (the last value seen wins): the cost is their weighted sum.
    Body(Vec<Field>),
}

/// One field of the body and its weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    /// How the policy named it (a pointer, or the preset's), for explain.
    pub name: String,
    /// Where it may be (any of these; a preset lists a stream's places too).
    pub pointers: Vec<Vec<String>>,
    /// Its weight in thousandths.
    pub weight_milli: u64,
    /// Subtracted, not added (a price's cached input tokens where the
    /// provider counts them in the input too); the sum is never below 0.
    pub negative: bool,
    /// Absent counts 0 (a price's cached tokens), not a missing figure.
    pub optional: bool,
}

/// Where the estimate charged on the request comes from (else `cost`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Estimate {
    /// The class's `cost`.
    Cost,
    /// A trusted request header's integer (lower-cased name).
    Header(String),
    /// A field of the request's JSON body, read as it passes: `name` as
    /// the policy wrote it (a top-level field's name, or a JSON pointer),
    /// `pointer` its segments.
    BodyField { name: String, pointer: Vec<String> },
}

/// Most `estimate_input_bytes_per_token`.
pub const MAX_BYTES_PER_TOKEN: i64 = 64;

impl Settle {
    /// The fields a body source reads (none for a header or trailer).
    pub fn fields(&self) -> &[Field] {
        match &self.source {
            Source::Body(f) => f,
            Source::Header(_) | Source::Trailer(_) => &[],
        }
    }
}

impl UsagePreset {
    /// The policy's name of the preset.
    pub fn as_str(self) -> &'static str {
        match self {
            UsagePreset::OpenaiTotal => "openai_total",
            UsagePreset::OpenaiPrompt => "openai_prompt",
            UsagePreset::OpenaiCompletion => "openai_completion",
            UsagePreset::Anthropic => "anthropic",
            UsagePreset::Gemini => "gemini",
            UsagePreset::Bedrock => "bedrock",
        }
    }

    /// The preset's fields, each of weight 1.
    fn fields(self) -> Vec<Field> {
        let field = |name: &str, pointers: &[&[&str]]| Field {
            name: name.to_owned(),
            pointers: pointers
                .iter()
                .map(|p| p.iter().map(|s| (*s).to_owned()).collect())
                .collect(),
            weight_milli: WEIGHT_SCALE,
            negative: false,
            optional: false,
        };
        match self {
            // Chat Completions (JSON, or a stream's `include_usage` chunk),
            // the Responses API (JSON, or `response.completed`), and the
            // OpenAI-compatible servers (vLLM, Ollama's /v1).
            UsagePreset::OpenaiTotal => vec![field(
                "/usage/total_tokens",
                &[&["usage", "total_tokens"], &["response", "usage", "total_tokens"]],
            )],
            UsagePreset::OpenaiPrompt => vec![field(
                "/usage/prompt_tokens",
                &[
                    &["usage", "prompt_tokens"],
                    &["usage", "input_tokens"],
                    &["response", "usage", "input_tokens"],
                ],
            )],
            UsagePreset::OpenaiCompletion => vec![field(
                "/usage/completion_tokens",
                &[
                    &["usage", "completion_tokens"],
                    &["usage", "output_tokens"],
                    &["response", "usage", "output_tokens"],
                ],
            )],
            UsagePreset::Gemini => vec![field(
                "/usageMetadata/totalTokenCount",
                &[&["usageMetadata", "totalTokenCount"]],
            )],
            UsagePreset::Bedrock => vec![field(
                "/usage/totalTokens",
                &[&["usage", "totalTokens"], &["metadata", "usage", "totalTokens"]],
            )],
            UsagePreset::Anthropic => vec![
                field(
                    "/usage/input_tokens",
                    &[&["usage", "input_tokens"], &["message", "usage", "input_tokens"]],
                ),
                field(
                    "/usage/output_tokens",
                    &[
                        &["usage", "output_tokens"],
                        &["message", "usage", "output_tokens"],
                    ],
                ),
            ],
        }
    }
}

/// `routes.<class>.settle` (`None` without one, or after an error), for a
/// class whose `cost` (the default estimate) is `cost`.
pub fn compile_settle(
    r: &RouteSpec,
    cost: u64,
    prices: &super::prices::Prices,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Option<Settle> {
    let spec = r.settle.as_ref()?;
    let path = path.key("settle");
    let before = errors.len();
    let source = match &spec.price {
        None => compile_source(spec, &path, errors),
        Some(model) => compile_price(spec, model, prices, &path, errors),
    };
    let ceiling = compile_ceiling(spec.ceiling, cost, &path.key("ceiling"), errors);
    let max_body_bytes = match spec.max_body_bytes {
        None => DEFAULT_SETTLE_MAX_BODY_BYTES,
        Some(n) if (1..=MAX_SETTLE_MAX_BODY_BYTES).contains(&n) => n as u64,
        Some(_) => {
            errors.push(PolicyError::new(
                path.key("max_body_bytes"),
                format!("must be between 1 and {MAX_SETTLE_MAX_BODY_BYTES}"),
            ));
            0
        }
    };
    let estimate = compile_estimate(spec, &path, errors);
    let methods = compile_methods(spec.methods.as_deref(), &path.key("methods"), errors);
    let paths = compile_paths(spec.paths.as_deref(), &path.key("paths"), errors);
    let outcomes = compile_outcomes(spec.on_outcome.as_ref());
    let chunk = match spec.chunk {
        None => default_chunk(ceiling),
        Some(n) if n >= 1 && (n as u64) <= ceiling => n as u64,
        Some(_) => {
            errors.push(PolicyError::new(
                path.key("chunk"),
                format!("must be between 1 and the ceiling ({ceiling})"),
            ));
            0
        }
    };
    let terminal_event = !matches!(spec.usage, Some(UsagePreset::Gemini | UsagePreset::Bedrock));
    let include_usage = spec.include_usage.unwrap_or(false);
    let input_bytes_per_token = match spec.estimate_input_bytes_per_token {
        None => None,
        Some(n) if (1..=MAX_BYTES_PER_TOKEN).contains(&n) => Some(n as u64),
        Some(_) => {
            errors.push(PolicyError::new(
                path.key("estimate_input_bytes_per_token"),
                format!("must be between 1 and {MAX_BYTES_PER_TOKEN}"),
            ));
            None
        }
    };
    if include_usage && !matches!(source, Some(Source::Body(_))) && source.is_some() {
        errors.push(PolicyError::new(
            path.key("include_usage"),
            "reads the usage from the answer's body: needs `usage` or `fields`, not a header or trailer",
        ));
    }
    if errors.len() > before {
        return None;
    }
    Some(Settle {
        chunk,
        over_reservation: spec.over_reservation.unwrap_or_default(),
        terminal_event,
        source: source?,
        ceiling,
        on_missing: spec.on_missing.unwrap_or_default(),
        max_body_bytes,
        estimate,
        methods,
        paths,
        outcomes,
        include_usage,
        input_bytes_per_token,
        price: spec.price.clone(),
    })
}

/// `settle.ceiling`: above 0, at most [`MAX_COUNT`], at least the class's
/// `cost` (0 after an error).
fn compile_ceiling(ceiling: i64, cost: u64, path: &FieldPath, errors: &mut Vec<PolicyError>) -> u64 {
    match ceiling {
        n if n <= 0 => {
            errors.push(PolicyError::new(path.clone(), "must be > 0"));
            0
        }
        n if n > MAX_COUNT => {
            errors.push(PolicyError::new(
                path.clone(),
                format!("must be at most {}", MAX_COUNT),
            ));
            0
        }
        n if (n as u64) < cost => {
            errors.push(PolicyError::new(
                path.clone(),
                format!("{n} is below the class's cost ({cost}), the estimate charged on the request"),
            ));
            0
        }
        n => n as u64,
    }
}

/// `settle.on_outcome`: each outcome's charge, its default where absent.
fn compile_outcomes(o: Option<&OutcomeSpec>) -> Outcomes {
    let pick = |f: fn(&OutcomeSpec) -> Option<Charge>, default: Charge| o.and_then(f).unwrap_or(default);
    let d = Outcomes::default();
    Outcomes {
        upstream_5xx: pick(|o| o.upstream_5xx, d.upstream_5xx),
        upstream_4xx: pick(|o| o.upstream_4xx, d.upstream_4xx),
        local_reply: pick(|o| o.local_reply, d.local_reply),
        no_response: pick(|o| o.no_response, d.no_response),
    }
}

/// `settle.methods`: 1 to [`MAX_MATCHES`] HTTP method tokens, kept
/// upper-case; absent: [`DEFAULT_METHODS`].
fn compile_methods(spec: Option<&[String]>, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Vec<String> {
    let Some(methods) = spec else {
        return DEFAULT_METHODS.iter().map(|m| (*m).to_owned()).collect();
    };
    if methods.is_empty() || methods.len() > MAX_MATCHES {
        errors.push(PolicyError::new(
            path.clone(),
            format!("1 to {MAX_MATCHES} methods"),
        ));
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, m) in methods.iter().enumerate() {
        if m.is_empty() || m.len() > 32 || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
            errors.push(PolicyError::new(
                path.index(i),
                "must be an HTTP method (letters only, such as POST)",
            ));
        } else {
            out.push(m.to_ascii_uppercase());
        }
    }
    out
}

/// `settle.paths`: 1 to [`MAX_MATCHES`] path prefixes starting with `/`;
/// absent: every path.
fn compile_paths(spec: Option<&[String]>, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Vec<String> {
    let Some(paths) = spec else {
        return Vec::new();
    };
    if paths.is_empty() || paths.len() > MAX_MATCHES {
        errors.push(PolicyError::new(
            path.clone(),
            format!("1 to {MAX_MATCHES} path prefixes"),
        ));
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        let ok = p.starts_with('/')
            && p.len() <= MAX_PATH_PREFIX
            && p.bytes().all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#');
        if ok {
            out.push(p.clone());
        } else {
            errors.push(PolicyError::new(
                path.index(i),
                format!("must be a path prefix: `/` then at most {MAX_PATH_PREFIX} visible characters, no `?` or `#`"),
            ));
        }
    }
    out
}

impl Settle {
    /// A request of `method` on `path` is in the metered operation.
    pub fn meters(&self, method: &[u8], path: &[u8]) -> bool {
        let path = path.split(|b| *b == b'?').next().unwrap_or_default();
        self.methods.iter().any(|m| m.as_bytes() == method)
            && (self.paths.is_empty() || self.paths.iter().any(|p| path.starts_with(p.as_bytes())))
    }
}

/// Exactly one of `header`, `trailer`, `usage`, `fields`.
fn compile_source(spec: &SettleSpec, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Option<Source> {
    let set = [
        spec.header.is_some(),
        spec.trailer.is_some(),
        spec.usage.is_some(),
        spec.fields.is_some(),
    ]
    .iter()
    .filter(|s| **s)
    .count();
    if set != 1 {
        errors.push(PolicyError::new(
            path.clone(),
            "set exactly one of `header`, `trailer`, `usage` or `fields`: where the upstream's response carries the cost",
        ));
        return None;
    }
    let header = |field: &str, name: &str, errors: &mut Vec<PolicyError>| {
        if is_header_name(name) {
            Some(name.to_ascii_lowercase())
        } else {
            errors.push(PolicyError::new(
                path.key(field),
                "must be an HTTP header name (letters, digits, - _ .)",
            ));
            None
        }
    };
    if let Some(h) = &spec.header {
        return header("header", h, errors).map(Source::Header);
    }
    if let Some(t) = &spec.trailer {
        return header("trailer", t, errors).map(Source::Trailer);
    }
    if let Some(u) = spec.usage {
        return Some(Source::Body(u.fields()));
    }
    let specs = spec.fields.as_deref().unwrap_or_default();
    if specs.is_empty() || specs.len() > MAX_FIELDS {
        errors.push(PolicyError::new(
            path.key("fields"),
            format!("1 to {MAX_FIELDS} fields"),
        ));
        return None;
    }
    let fields: Vec<Option<Field>> = specs
        .iter()
        .enumerate()
        .map(|(i, f)| compile_field(f, &path.key("fields").index(i), errors))
        .collect();
    fields
        .into_iter()
        .collect::<Option<Vec<Field>>>()
        .map(Source::Body)
}

/// `settle.price`: a model of the catalogue, with `usage` naming the
/// provider whose usage fields are priced (see [`super::prices`]). The
/// estimate is then in micro-units too: not read from the request's
/// body, which counts tokens.
fn compile_price(
    spec: &SettleSpec,
    model: &str,
    prices: &super::prices::Prices,
    path: &FieldPath,
    errors: &mut Vec<PolicyError>,
) -> Option<Source> {
    let at = path.key("price");
    if spec.header.is_some() || spec.trailer.is_some() || spec.fields.is_some() {
        errors.push(PolicyError::new(
            at.clone(),
            "prices a provider's usage: set `usage` (the provider), not `header`, `trailer` or `fields`",
        ));
        return None;
    }
    let Some(provider) = spec.usage else {
        errors.push(PolicyError::new(
            at.clone(),
            "needs `usage`: the provider whose usage fields are priced (openai_total, anthropic, gemini, bedrock)",
        ));
        return None;
    };
    if spec.estimate_body_field.is_some() || spec.estimate_input_bytes_per_token.is_some() {
        errors.push(PolicyError::new(
            at.clone(),
            "the estimate is in micro-units of the currency, and the request's body counts tokens: use `cost` or `estimate_header`",
        ));
    }
    match prices.models.get(model) {
        Some(price) => Some(Source::Body(price.fields(provider))),
        None => {
            let known: Vec<&str> = prices.models.keys().map(String::as_str).collect();
            errors.push(PolicyError::new(
                at,
                format!(
                    "unknown model `{model}` (prices.models: {})",
                    if known.is_empty() {
                        "none: add a `prices:` catalogue".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
            None
        }
    }
}

/// One `fields[]` entry: its pointer and weight.
fn compile_field(f: &FieldSpec, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Option<Field> {
    let pointer = match parse_pointer(&f.pointer) {
        Some(p) => p,
        None => {
            errors.push(PolicyError::new(
                path.key("pointer"),
                format!(
                    "must be a JSON pointer like /usage/total_tokens: 1 to {MAX_POINTER_SEGMENTS} segments of 1 to {MAX_SEGMENT_LEN} bytes"
                ),
            ));
            return None;
        }
    };
    let weight = f.weight.unwrap_or(1.0);
    let milli = weight * WEIGHT_SCALE as f64;
    if !(weight > 0.0 && weight <= MAX_WEIGHT) || (milli - milli.round()).abs() > 1e-6 {
        errors.push(PolicyError::new(
            path.key("weight"),
            format!("must be more than 0 and at most {MAX_WEIGHT}, with at most three decimals"),
        ));
        return None;
    }
    Some(Field {
        name: f.pointer.clone(),
        pointers: vec![pointer],
        weight_milli: milli.round() as u64,
        negative: false,
        optional: false,
    })
}

/// An RFC 6901 JSON pointer's segments (`~1` is `/`, `~0` is `~`); `None`
/// if it is not one, or too deep or long.
pub fn parse_pointer(pointer: &str) -> Option<Vec<String>> {
    let rest = pointer.strip_prefix('/')?;
    let segments: Vec<String> = rest
        .split('/')
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect();
    let ok = !segments.is_empty()
        && segments.len() <= MAX_POINTER_SEGMENTS
        && segments
            .iter()
            .all(|s| !s.is_empty() && s.len() <= MAX_SEGMENT_LEN);
    ok.then_some(segments)
}

/// `estimate_header` or `estimate_body_field` (at most one), else `cost`.
fn compile_estimate(spec: &SettleSpec, path: &FieldPath, errors: &mut Vec<PolicyError>) -> Estimate {
    match (&spec.estimate_header, &spec.estimate_body_field) {
        (None, None) => Estimate::Cost,
        (Some(_), Some(_)) => {
            errors.push(PolicyError::new(
                path.key("estimate_body_field"),
                "set at most one of `estimate_header` or `estimate_body_field`",
            ));
            Estimate::Cost
        }
        (Some(h), None) if is_header_name(h) => Estimate::Header(h.to_ascii_lowercase()),
        (Some(_), None) => {
            errors.push(PolicyError::new(
                path.key("estimate_header"),
                "must be an HTTP header name (letters, digits, - _ .)",
            ));
            Estimate::Cost
        }
        (None, Some(f)) if super::is_name(f) => Estimate::BodyField {
            name: f.clone(),
            pointer: vec![f.clone()],
        },
        (None, Some(f)) => match f.starts_with('/').then(|| parse_pointer(f)).flatten() {
            Some(pointer) => Estimate::BodyField {
                name: f.clone(),
                pointer,
            },
            None => {
                errors.push(PolicyError::new(
                    path.key("estimate_body_field"),
                    format!(
                        "must be a top-level field name (1 to 64 characters of A-Z a-z 0-9 _ - .) or a JSON pointer like /generationConfig/maxOutputTokens (1 to {MAX_POINTER_SEGMENTS} segments)"
                    ),
                ));
                Estimate::Cost
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_follow_rfc_6901_and_are_bounded() {
        assert_eq!(
            parse_pointer("/usage/total_tokens"),
            Some(vec!["usage".to_owned(), "total_tokens".to_owned()])
        );
        assert_eq!(
            parse_pointer("/a~1b/c~0d"),
            Some(vec!["a/b".into(), "c~d".into()])
        );
        for bad in ["", "usage", "/", "/a//b", "/a/b/c/d/e/f/g/h/i"] {
            assert_eq!(parse_pointer(bad), None, "{bad}");
        }
        assert_eq!(parse_pointer(&format!("/{}", "x".repeat(65))), None);
    }
}
