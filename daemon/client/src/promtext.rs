//! A small parser for the Prometheus text exposition format (version 0.0.4),
//! and the kvwired counters and hop histograms read back out of it — what
//! `kvwire stats` prints. Pure: text in, values out.

use serde::Serialize;

/// Label pairs in the order written.
pub type Labels = Vec<(String, String)>;

/// One sample line: `name{label="value",…} value [timestamp]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name, e.g. `kvwire_hop_seconds_bucket`.
    pub name: String,
    /// Labels in the order written.
    pub labels: Labels,
    /// The value (`+Inf`, `-Inf` and `NaN` included).
    pub value: f64,
    /// 1-based line number in the text, for error messages.
    pub line: usize,
}

impl Sample {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// Why metrics text was refused.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// A line is not a valid sample or comment.
    #[error("metrics text line {line}: {reason}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The text parsed but is not kvwired's metrics.
    #[error("metrics text lacks `{metric}`: not a kvwired metrics endpoint?")]
    Missing {
        /// The metric that was expected.
        metric: String,
    },
    /// A sample has a value its metric cannot hold.
    #[error("metrics text line {line}: `{metric}`: {reason}")]
    Value {
        /// 1-based line number.
        line: usize,
        /// The metric.
        metric: String,
        /// Why.
        reason: String,
    },
}

fn syntax(line: usize, reason: impl Into<String>) -> ParseError {
    ParseError::Syntax { line, reason: reason.into() }
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// Parses a Prometheus value: a float, `+Inf`, `-Inf` or `NaN`.
pub fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => {
            // Rust accepts "inf"/"infinity"/"nan" spellings the format does not.
            if s.chars().any(|c| c.is_ascii_alphabetic() && c != 'e' && c != 'E') {
                return None;
            }
            s.parse::<f64>().ok()
        }
    }
}

/// Parses every sample of `text`; comments (`# HELP`, `# TYPE`, others) and
/// blank lines are skipped.
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        out.push(parse_line(line, l)?);
    }
    Ok(out)
}

fn parse_line(line: usize, l: &str) -> Result<Sample, ParseError> {
    let name_end = l.find(|c: char| !is_name_char(c)).unwrap_or(l.len());
    let name = &l[..name_end];
    if !name.starts_with(is_name_start) {
        return Err(syntax(line, format!("expected a metric name, found `{}`", first_word(l))));
    }
    let mut rest = &l[name_end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let (ls, after) = parse_labels(line, r)?;
        labels = ls;
        rest = after;
    }
    if !rest.starts_with([' ', '\t']) {
        return Err(syntax(line, format!("`{name}`: expected a space before the value, found `{}`", first_word(rest))));
    }
    let mut fields = rest.split_whitespace();
    let v = fields.next().ok_or_else(|| syntax(line, format!("`{name}` has no value")))?;
    let value = parse_value(v).ok_or_else(|| syntax(line, format!("`{name}`: `{v}` is not a number")))?;
    if let Some(ts) = fields.next() {
        if ts.parse::<i64>().is_err() {
            return Err(syntax(line, format!("`{name}`: `{ts}` is not a timestamp")));
        }
    }
    if let Some(extra) = fields.next() {
        return Err(syntax(line, format!("`{name}`: unexpected `{extra}` after the value")));
    }
    Ok(Sample { name: name.to_string(), labels, value, line })
}

fn first_word(s: &str) -> &str {
    let s = s.trim_start();
    let end = s.find(char::is_whitespace).unwrap_or(s.len()).min(40);
    let mut end = end;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Parses `a="x",b="y"}` (the opening brace already consumed); returns the
/// labels and what follows the closing brace.
fn parse_labels(line: usize, mut s: &str) -> Result<(Labels, &str), ParseError> {
    let mut labels = Labels::new();
    loop {
        s = s.trim_start();
        if let Some(r) = s.strip_prefix('}') {
            return Ok((labels, r));
        }
        let end = s.find(|c: char| !is_name_char(c)).unwrap_or(s.len());
        let key = &s[..end];
        if !key.starts_with(is_name_start) {
            return Err(syntax(line, format!("expected a label name, found `{}`", first_word(s))));
        }
        s = s[end..].trim_start();
        s = s.strip_prefix('=').ok_or_else(|| syntax(line, format!("label `{key}`: expected `=`")))?.trim_start();
        s = s.strip_prefix('"').ok_or_else(|| syntax(line, format!("label `{key}`: value must be quoted")))?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let close = loop {
            match chars.next() {
                None => return Err(syntax(line, format!("label `{key}`: unterminated value"))),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => return Err(syntax(line, format!("label `{key}`: unknown escape `\\{c}`"))),
                    None => return Err(syntax(line, format!("label `{key}`: unterminated value"))),
                },
                Some((_, c)) => value.push(c),
            }
        };
        if labels.iter().any(|(k, _)| k == key) {
            return Err(syntax(line, format!("label `{key}` given twice")));
        }
        labels.push((key.to_string(), value));
        s = s[close + 1..].trim_start();
        if let Some(r) = s.strip_prefix(',') {
            s = r;
        } else if !s.starts_with('}') {
            return Err(syntax(line, format!("after label `{key}`: expected `,` or `}}`")));
        }
    }
}

// ------------------------------------------------------------ kvwired's metrics

/// Transfers with one role and outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TransferCount {
    /// `source`, `destination` or `any`.
    pub role: String,
    /// `done`, `failed` or `cancelled`.
    pub outcome: String,
    /// How many.
    pub count: u64,
}

/// Transfers that began one way (`kvwire_starts_total`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StartCount {
    /// `announced` (receives announced here), `claimed` or `offered`
    /// (transfers sent from here).
    pub how: String,
    /// How many.
    pub count: u64,
}

/// Connections a daemon's transfers used, one kind and one way
/// (`kvwire_peer_connections_total`, `kvwire_data_connections_total`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConnectionCount {
    /// `peer` (authenticated peer connections) or `data` (data-plane
    /// connections, one per rail).
    pub kind: String,
    /// `opened` for the transfer, or `reused` (kept from an earlier one).
    pub how: String,
    /// How many.
    pub count: u64,
}

/// A registered device allocation and how a source reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    /// Its group.
    pub group: String,
    /// Its rank.
    pub rank: u32,
    /// Its index in the rank.
    pub memory: u32,
    /// `direct` (in place by the NIC, GPUDirect) or `staged` (through a ring).
    pub path: String,
    /// Direct: the registration; staged: why the NIC does not read it in place.
    pub detail: String,
}

/// Refusals of one kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusalCount {
    /// `peer` or `client`.
    pub who: String,
    /// How many.
    pub count: u64,
}

/// The byte counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ByteCounters {
    /// `kvwire_payload_bytes_total`.
    pub payload_bytes: u64,
    /// `kvwire_wire_bytes_total`.
    pub wire_bytes: u64,
    /// `kvwire_reused_bytes_total`.
    pub reused_bytes: u64,
    /// `kvwire_retransmitted_bytes_total`.
    pub retransmitted_bytes: u64,
    /// `kvwire_compressed_bytes_total` (0 from a daemon that does not report it).
    pub compressed_bytes: u64,
    /// `kvwire_received_bytes_total`.
    pub received_bytes: u64,
}

/// Where a hop's latency figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LatencyFrom {
    /// The daemon's hdrhistogram itself (`kvwire_hop_quantile_seconds`):
    /// p50, p90, p99, p99.9 and max within 0.1% of recorded samples.
    Histogram,
    /// p50/p99 interpolated linearly inside histogram buckets (as
    /// Prometheus' `histogram_quantile` does).
    Buckets,
    /// No finite buckets: only the mean, `sum / count`.
    Mean,
}

/// One hop's histogram, summarised.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HopStats {
    /// Hop name (`pack`, `wire`, …).
    pub hop: String,
    /// Samples.
    pub count: u64,
    /// Sum of samples, seconds.
    pub sum_seconds: f64,
    /// `sum / count`, seconds; `None` without samples.
    pub mean_seconds: Option<f64>,
    /// Median, seconds; `None` without samples (estimated from buckets
    /// when the daemon gives no quantiles).
    pub p50_seconds: Option<f64>,
    /// 90th percentile, seconds; `None` unless the daemon gives it.
    pub p90_seconds: Option<f64>,
    /// 99th percentile, seconds; `None` without samples (estimated from
    /// buckets when the daemon gives no quantiles).
    pub p99_seconds: Option<f64>,
    /// 99.9th percentile, seconds; `None` unless the daemon gives it.
    pub p999_seconds: Option<f64>,
    /// Largest sample, seconds; `None` unless the daemon gives it.
    pub max_seconds: Option<f64>,
    /// What the latency figures are computed from.
    pub latency_from: LatencyFrom,
    /// Bytes attributed to the hop.
    pub bytes: u64,
    /// Effective bandwidth, `bytes / sum_seconds`; `None` when no time was spent.
    pub bandwidth_bytes_per_second: Option<f64>,
    /// Cumulative buckets `(upper bound in seconds, count)`, finite bounds only, ascending.
    #[serde(skip)]
    pub buckets: Vec<(f64, u64)>,
}

/// Everything `kvwire stats` shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    /// The daemon's node name (the `node` label), if the samples carry one.
    pub node: Option<String>,
    /// Byte counters.
    pub counters: ByteCounters,
    /// Transfers by role and outcome, in the order the daemon lists them.
    pub transfers: Vec<TransferCount>,
    /// How transfers began, in the order the daemon lists them (empty
    /// from a daemon that does not count them).
    pub starts: Vec<StartCount>,
    /// Connections transfers used, peer then data, in the order the daemon
    /// lists them (empty from a daemon that does not count them).
    pub connections: Vec<ConnectionCount>,
    /// Refusals, in the order the daemon lists them.
    pub refused: Vec<RefusalCount>,
    /// Writes the data plane refused, by reason (`who` is the reason), in
    /// the order the daemon lists them (empty from a daemon that does not
    /// count them).
    pub writes_refused: Vec<RefusalCount>,
    /// Hop table, in the order the daemon lists the hops.
    pub hops: Vec<HopStats>,
    /// Registered device allocations and their source paths (empty from a
    /// daemon without any, or one that does not report them).
    pub device_memory: Vec<DeviceMemory>,
}

/// A counter value as an integer: finite, non-negative and whole.
fn count(s: &Sample) -> Result<u64, ParseError> {
    let v = s.value;
    if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= u64::MAX as f64 {
        Ok(v as u64)
    } else {
        Err(ParseError::Value { line: s.line, metric: s.name.clone(), reason: format!("{v} is not a whole count") })
    }
}

fn need<'a>(s: &'a Sample, label: &str) -> Result<&'a str, ParseError> {
    s.label(label).ok_or_else(|| ParseError::Value { line: s.line, metric: s.name.clone(), reason: format!("no `{label}` label") })
}

/// Estimates quantile `q` (0..=1) from cumulative `buckets` (finite upper
/// bounds ascending) and the total `count`, interpolating linearly inside the
/// bucket that holds rank `q * count`, with 0 as the lowest bound. A rank past
/// the last finite bucket answers that bucket's bound (as Prometheus does).
pub fn bucket_quantile(q: f64, buckets: &[(f64, u64)], count: u64) -> Option<f64> {
    if count == 0 || buckets.is_empty() {
        return None;
    }
    let rank = q * count as f64;
    let (mut lower, mut below) = (0.0, 0u64);
    for &(bound, cum) in buckets {
        if cum as f64 >= rank && cum > below {
            return Some(lower + (bound - lower) * (rank - below as f64) / (cum - below) as f64);
        }
        lower = bound;
        below = cum;
    }
    Some(lower)
}

impl Stats {
    /// Reads kvwired's metrics out of Prometheus text.
    pub fn from_text(text: &str) -> Result<Stats, ParseError> {
        Stats::from_samples(&parse(text)?)
    }

    /// Reads kvwired's metrics out of parsed samples.
    pub fn from_samples(samples: &[Sample]) -> Result<Stats, ParseError> {
        let counter = |name: &str| -> Result<u64, ParseError> {
            let s = samples.iter().find(|s| s.name == name).ok_or_else(|| ParseError::Missing { metric: name.into() })?;
            count(s)
        };
        let counters = ByteCounters {
            payload_bytes: counter("kvwire_payload_bytes_total")?,
            wire_bytes: counter("kvwire_wire_bytes_total")?,
            reused_bytes: counter("kvwire_reused_bytes_total")?,
            retransmitted_bytes: counter("kvwire_retransmitted_bytes_total")?,
            compressed_bytes: samples.iter().find(|s| s.name == "kvwire_compressed_bytes_total").map(count).transpose()?.unwrap_or(0),
            received_bytes: counter("kvwire_received_bytes_total")?,
        };
        let node = samples.iter().find_map(|s| s.label("node")).map(str::to_string);
        let mut transfers = Vec::new();
        let mut refused = Vec::new();
        let mut writes_refused = Vec::new();
        let mut starts = Vec::new();
        let mut connections = Vec::new();
        let mut device_memory = Vec::new();
        let mut hops: Vec<HopStats> = Vec::new();
        fn hop_mut<'h>(hops: &'h mut Vec<HopStats>, name: &str) -> &'h mut HopStats {
            let i = match hops.iter().position(|h| h.hop == name) {
                Some(i) => i,
                None => {
                    hops.push(HopStats {
                        hop: name.to_string(),
                        count: 0,
                        sum_seconds: 0.0,
                        mean_seconds: None,
                        p50_seconds: None,
                        p90_seconds: None,
                        p99_seconds: None,
                        p999_seconds: None,
                        max_seconds: None,
                        latency_from: LatencyFrom::Mean,
                        bytes: 0,
                        bandwidth_bytes_per_second: None,
                        buckets: Vec::new(),
                    });
                    hops.len() - 1
                }
            };
            &mut hops[i]
        }
        let mut inf_buckets: Vec<(String, u64, usize)> = Vec::new();
        // (hop, quantile, seconds) from the histograms themselves.
        let mut quantiles: Vec<(String, f64, f64)> = Vec::new();
        for s in samples {
            match s.name.as_str() {
                "kvwire_transfers_total" => transfers.push(TransferCount {
                    role: need(s, "role")?.to_string(),
                    outcome: need(s, "outcome")?.to_string(),
                    count: count(s)?,
                }),
                "kvwire_refused_total" => refused.push(RefusalCount { who: need(s, "who")?.to_string(), count: count(s)? }),
                "kvwire_writes_refused_total" => writes_refused.push(RefusalCount { who: need(s, "reason")?.to_string(), count: count(s)? }),
                "kvwire_starts_total" => starts.push(StartCount { how: need(s, "how")?.to_string(), count: count(s)? }),
                "kvwire_peer_connections_total" | "kvwire_data_connections_total" => connections.push(ConnectionCount {
                    kind: if s.name == "kvwire_peer_connections_total" { "peer" } else { "data" }.to_string(),
                    how: need(s, "how")?.to_string(),
                    count: count(s)?,
                }),
                "kvwire_device_memory" => {
                    let number = |label: &str| -> Result<u32, ParseError> {
                        need(s, label)?.parse().map_err(|_| ParseError::Value { line: s.line, metric: s.name.clone(), reason: format!("`{label}` is not a number") })
                    };
                    let path = need(s, "path")?.to_string();
                    let detail = need(s, if path == "direct" { "how" } else { "why" })?.to_string();
                    device_memory.push(DeviceMemory { group: need(s, "group")?.to_string(), rank: number("rank")?, memory: number("memory")?, path, detail });
                }
                "kvwire_hop_seconds_bucket" => {
                    let hop = need(s, "hop")?;
                    let le = need(s, "le")?;
                    let bound = parse_value(le).filter(|b| !b.is_nan()).ok_or_else(|| ParseError::Value {
                        line: s.line,
                        metric: s.name.clone(),
                        reason: format!("le=\"{le}\" is not a bucket bound"),
                    })?;
                    let c = count(s)?;
                    let h = hop_mut(&mut hops, hop);
                    if bound.is_infinite() {
                        inf_buckets.push((hop.to_string(), c, s.line));
                    } else {
                        h.buckets.push((bound, c));
                    }
                }
                "kvwire_hop_seconds_sum" => {
                    let v = s.value;
                    if !(v.is_finite() && v >= 0.0) {
                        return Err(ParseError::Value { line: s.line, metric: s.name.clone(), reason: format!("{v} is not a duration") });
                    }
                    hop_mut(&mut hops, need(s, "hop")?).sum_seconds = v;
                }
                "kvwire_hop_seconds_count" => hop_mut(&mut hops, need(s, "hop")?).count = count(s)?,
                "kvwire_hop_bytes_total" => hop_mut(&mut hops, need(s, "hop")?).bytes = count(s)?,
                "kvwire_hop_quantile_seconds" => {
                    let bad = |reason: String| ParseError::Value { line: s.line, metric: s.name.clone(), reason };
                    let q = need(s, "quantile")?;
                    let qv = parse_value(q).filter(|q| (0.0..=1.0).contains(q)).ok_or_else(|| bad(format!("quantile=\"{q}\" is not in 0..=1")))?;
                    if !(s.value.is_finite() && s.value >= 0.0) {
                        return Err(bad(format!("{} is not a duration", s.value)));
                    }
                    quantiles.push((need(s, "hop")?.to_string(), qv, s.value));
                }
                _ => {}
            }
        }
        for h in &mut hops {
            h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            for w in h.buckets.windows(2) {
                if w[1].1 < w[0].1 {
                    return Err(ParseError::Value {
                        line: 0,
                        metric: "kvwire_hop_seconds_bucket".into(),
                        reason: format!("hop `{}`: buckets are not cumulative (le={} has {}, le={} has {})", h.hop, w[0].0, w[0].1, w[1].0, w[1].1),
                    });
                }
            }
            if let Some(&(b, c)) = h.buckets.last() {
                if c > h.count {
                    return Err(ParseError::Value {
                        line: 0,
                        metric: "kvwire_hop_seconds_bucket".into(),
                        reason: format!("hop `{}`: bucket le={b} counts {c}, more than the {} samples", h.hop, h.count),
                    });
                }
            }
            if let Some((_, c, line)) = inf_buckets.iter().find(|(n, ..)| *n == h.hop) {
                if *c != h.count {
                    return Err(ParseError::Value {
                        line: *line,
                        metric: "kvwire_hop_seconds_bucket".into(),
                        reason: format!("hop `{}`: le=\"+Inf\" counts {c} but _count is {}", h.hop, h.count),
                    });
                }
            }
            let q = |want: f64| quantiles.iter().find(|(hop, q, _)| *hop == h.hop && *q == want).map(|&(_, _, v)| v);
            h.latency_from = if h.buckets.is_empty() { LatencyFrom::Mean } else { LatencyFrom::Buckets };
            if h.count > 0 {
                h.mean_seconds = Some(h.sum_seconds / h.count as f64);
                if let (Some(p50), Some(p99)) = (q(0.5), q(0.99)) {
                    h.latency_from = LatencyFrom::Histogram;
                    (h.p50_seconds, h.p90_seconds, h.p99_seconds, h.p999_seconds, h.max_seconds) = (Some(p50), q(0.9), Some(p99), q(0.999), q(1.0));
                } else {
                    h.p50_seconds = bucket_quantile(0.5, &h.buckets, h.count);
                    h.p99_seconds = bucket_quantile(0.99, &h.buckets, h.count);
                }
            }
            if h.sum_seconds > 0.0 {
                h.bandwidth_bytes_per_second = Some(h.bytes as f64 / h.sum_seconds);
            }
        }
        Ok(Stats { node, counters, transfers, starts, connections, refused, writes_refused, hops, device_memory })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_with_escapes_and_timestamps() {
        let s = parse("# HELP x y\n\nm{a=\"q\\\"x\\\\y\\n\",b=\"\"} 1.5e3 1700000000\nn +Inf\n").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].labels, vec![("a".into(), "q\"x\\y\n".into()), ("b".into(), String::new())]);
        assert_eq!(s[0].value, 1500.0);
        assert_eq!((s[1].name.as_str(), s[1].value, s[1].line), ("n", f64::INFINITY, 4));
    }

    #[test]
    fn syntax_errors_name_the_line() {
        for (text, needle) in [
            ("ok 1\nm{a=\"x\" 2\n", "line 2"),
            ("m{a=x} 1\n", "quoted"),
            ("m 1 2 3\n", "unexpected `3`"),
            ("m abc\n", "`abc` is not a number"),
            ("m inf\n", "not a number"),
            ("m{a=\"x\",a=\"y\"} 1\n", "given twice"),
            ("9m 1\n", "metric name"),
            ("m{a=\"x\"}1\n", "space"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn quantile_interpolates_inside_the_bucket() {
        // 10 samples: 4 ≤ 1 s, 8 ≤ 2 s, 10 ≤ 4 s.
        let b = [(1.0, 4), (2.0, 8), (4.0, 10)];
        // Median: rank 5, in (1, 2] which holds ranks 5..=8 → 1 + 1 * (5-4)/4.
        assert_eq!(bucket_quantile(0.5, &b, 10), Some(1.25));
        // p99: rank 9.9, in (2, 4] holding 2 → 2 + 2 * 1.9/2.
        assert!((bucket_quantile(0.99, &b, 10).unwrap() - 3.9).abs() < 1e-12);
        // Past the last finite bucket: its bound.
        assert_eq!(bucket_quantile(0.99, &[(1.0, 4)], 10), Some(1.0));
        assert_eq!(bucket_quantile(0.5, &b, 0), None);
    }
}
