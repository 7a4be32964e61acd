//! A hand-written SVG chart of one run: admitted and demanded units per
//! second against the limit's rate.

use std::fmt::Write;

const W: f64 = 900.0;
const H: f64 = 320.0;
const PAD: f64 = 48.0;

fn polyline(out: &mut String, values: &[f64], y_max: f64, style: &str) {
    let n = values.len().max(2) - 1;
    let points: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let x = PAD + (W - 2.0 * PAD) * i as f64 / n as f64;
            let y = H - PAD - (H - 2.0 * PAD) * (v / y_max).min(1.0);
            format!("{x:.1},{y:.1}")
        })
        .collect();
    let _ = writeln!(
        out,
        r#"<polyline fill="none" {style} points="{}"/>"#,
        points.join(" ")
    );
}

/// The chart of `admitted_s` and `demand_s` (units per second) against
/// `rate_per_s`, titled `title`.
pub fn chart(title: &str, admitted_s: &[u64], demand_s: &[u64], rate_per_s: f64) -> String {
    let peak = admitted_s
        .iter()
        .chain(demand_s)
        .map(|&v| v as f64)
        .fold(rate_per_s, f64::max);
    let y_max = peak * 1.1;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="{PAD}" y="20" font-size="14">{}</text>"#,
        escape(title)
    );
    let (x0, x1, y0, y1) = (PAD, W - PAD, H - PAD, PAD);
    let _ = writeln!(
        out,
        r##"<path d="M{x0},{y1} V{y0} H{x1}" stroke="#444" fill="none"/>"##
    );
    let limit_y = H - PAD - (H - 2.0 * PAD) * rate_per_s / y_max;
    let _ = writeln!(
        out,
        r##"<line x1="{x0}" y1="{limit_y:.1}" x2="{x1}" y2="{limit_y:.1}" stroke="#c00" stroke-dasharray="6,4"/>"##
    );
    let _ = writeln!(
        out,
        r##"<text x="{}" y="{:.1}" fill="#c00">limit {rate_per_s:.0}/s</text>"##,
        x1 - 90.0,
        limit_y - 4.0
    );
    let to_f = |v: &[u64]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    polyline(
        &mut out,
        &to_f(demand_s),
        y_max,
        r##"stroke="#999" stroke-width="1""##,
    );
    polyline(
        &mut out,
        &to_f(admitted_s),
        y_max,
        r##"stroke="#06c" stroke-width="1.5""##,
    );
    let secs = admitted_s.len();
    let _ = writeln!(out, r#"<text x="{x0}" y="{}">0 s</text>"#, H - PAD + 16.0);
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}">{secs} s</text>"#,
        x1 - 24.0,
        H - PAD + 16.0
    );
    let _ = writeln!(
        out,
        r##"<text x="{}" y="{}"><tspan fill="#06c">admitted/s</tspan>  <tspan fill="#999">demand/s</tspan></text>"##,
        x0 + 8.0,
        PAD - 8.0
    );
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chart_is_one_svg_document_with_both_series() {
        let svg = chart("a <b>", &[1, 2, 3], &[4, 5, 6], 2.0);
        assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt;b&gt;"));
    }
}
