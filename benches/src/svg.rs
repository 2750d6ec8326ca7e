//! A tiny hand-written SVG writer for the campaign plots: shapes, escaped
//! text, linear and logarithmic scales, and a framed plot area with ticked,
//! labelled axes. Output is one standalone `<svg>` document (no scripts, no
//! external references), so a browser or an XML parser reads it as is.

use std::fmt::Write as _;

/// Escapes `s` for SVG text content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// A coordinate as SVG wants it: finite, two decimals.
fn n(v: f64) -> String {
    let v = if v.is_finite() { v } else { 0.0 };
    format!("{v:.2}")
}

/// A line or outline style.
#[derive(Debug, Clone, Copy)]
pub struct Stroke<'a> {
    /// Colour (any SVG colour).
    pub color: &'a str,
    /// Width in pixels.
    pub width: f64,
    /// Dashed.
    pub dashed: bool,
}

impl<'a> Stroke<'a> {
    /// A solid stroke.
    pub fn solid(color: &'a str, width: f64) -> Stroke<'a> {
        Stroke { color, width, dashed: false }
    }

    /// A dashed stroke.
    pub fn dashed(color: &'a str, width: f64) -> Stroke<'a> {
        Stroke { color, width, dashed: true }
    }

    fn attrs(&self) -> String {
        let dash = if self.dashed { r#" stroke-dasharray="6 4""# } else { "" };
        format!(r#"stroke="{}" stroke-width="{}" fill="none"{dash}"#, escape(self.color), n(self.width))
    }
}

/// Where text sits relative to its point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    /// Text starts at the point.
    Start,
    /// Text is centred on the point.
    Middle,
    /// Text ends at the point.
    End,
}

impl Anchor {
    fn name(self) -> &'static str {
        match self {
            Anchor::Start => "start",
            Anchor::Middle => "middle",
            Anchor::End => "end",
        }
    }
}

/// One SVG document being written.
#[derive(Debug)]
pub struct Svg {
    width: f64,
    height: f64,
    body: String,
}

impl Svg {
    /// A `width` × `height` pixel document with a white background and a `<title>`.
    pub fn new(width: f64, height: f64, title: &str) -> Svg {
        let mut body = String::new();
        let _ = writeln!(body, "<title>{}</title>", escape(title));
        let _ = writeln!(body, r#"<rect x="0" y="0" width="{}" height="{}" fill="white"/>"#, n(width), n(height));
        Svg { width, height, body }
    }

    /// A straight line.
    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), s: Stroke<'_>) {
        let _ = writeln!(self.body, r#"<line x1="{}" y1="{}" x2="{}" y2="{}" {}/>"#, n(x1), n(y1), n(x2), n(y2), s.attrs());
    }

    /// An open path through `points` (nothing for fewer than two).
    pub fn path(&mut self, points: &[(f64, f64)], s: Stroke<'_>) {
        if points.len() < 2 {
            return;
        }
        let mut d = String::new();
        for (i, (x, y)) in points.iter().enumerate() {
            let _ = write!(d, "{}{},{} ", if i == 0 { 'M' } else { 'L' }, n(*x), n(*y));
        }
        let _ = writeln!(self.body, r#"<path d="{}" {}/>"#, d.trim_end(), s.attrs());
    }

    /// A filled rectangle; negative sizes are normalised.
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: &str) {
        let (x, w) = if w < 0.0 { (x + w, -w) } else { (x, w) };
        let (y, h) = if h < 0.0 { (y + h, -h) } else { (y, h) };
        let _ = writeln!(self.body, r#"<rect x="{}" y="{}" width="{}" height="{}" fill="{}"/>"#, n(x), n(y), n(w), n(h), escape(fill));
    }

    /// A filled circle with a dark outline.
    pub fn circle(&mut self, cx: f64, cy: f64, r: f64, fill: &str) {
        let _ = writeln!(
            self.body,
            r#"<circle cx="{}" cy="{}" r="{}" fill="{}" stroke="black" stroke-width="1"/>"#,
            n(cx),
            n(cy),
            n(r),
            escape(fill)
        );
    }

    /// Text (escaped) of `size` pixels anchored at (x, y); `rotate` degrees about that point.
    pub fn text(&mut self, x: f64, y: f64, s: &str, size: f64, anchor: Anchor, rotate: f64) {
        let turn = if rotate == 0.0 { String::new() } else { format!(r#" transform="rotate({} {} {})""#, n(rotate), n(x), n(y)) };
        let _ = writeln!(
            self.body,
            r#"<text x="{}" y="{}" font-family="sans-serif" font-size="{}" text-anchor="{}"{turn}>{}</text>"#,
            n(x),
            n(y),
            n(size),
            anchor.name(),
            escape(s)
        );
    }

    /// The finished document.
    pub fn finish(self) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n{}</svg>\n",
            self.body,
            w = n(self.width),
            h = n(self.height)
        )
    }
}

/// Maps data values onto pixels, linearly or by log10.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    lo: f64,
    hi: f64,
    log: bool,
    from: f64,
    to: f64,
}

impl Scale {
    /// `lo..hi` onto pixels `from..to` (`to < from` for a y axis).
    pub fn linear(lo: f64, hi: f64, from: f64, to: f64) -> Scale {
        let (lo, hi) = if hi > lo { (lo, hi) } else { (lo, lo + 1.0) };
        Scale { lo, hi, log: false, from, to }
    }

    /// `lo..hi` (both > 0) onto pixels by log10, widened to whole decades.
    pub fn log(lo: f64, hi: f64, from: f64, to: f64) -> Scale {
        let lo = if lo > 0.0 && lo.is_finite() { lo } else { 1.0 };
        let hi = if hi > lo && hi.is_finite() { hi } else { lo * 10.0 };
        let lo = 10f64.powf(lo.log10().floor());
        let hi = 10f64.powf(hi.log10().ceil()).max(lo * 10.0);
        Scale { lo, hi, log: true, from, to }
    }

    /// The pixel of `v` (values outside the range are clamped to it).
    pub fn at(&self, v: f64) -> f64 {
        let v = if v.is_finite() { v.clamp(self.lo, self.hi) } else { self.lo };
        let f = if self.log { (v.log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10()) } else { (v - self.lo) / (self.hi - self.lo) };
        self.from + f * (self.to - self.from)
    }

    /// The range of values.
    pub fn range(&self) -> (f64, f64) {
        (self.lo, self.hi)
    }

    /// Tick values: decades on a log scale, about five round steps on a linear one.
    pub fn ticks(&self) -> Vec<f64> {
        if self.log {
            let (a, b) = (self.lo.log10().round() as i32, self.hi.log10().round() as i32);
            return (a..=b).map(|e| 10f64.powi(e)).collect();
        }
        let span = self.hi - self.lo;
        let raw = span / 5.0;
        let mag = 10f64.powf(raw.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| span / s <= 6.0).unwrap_or(mag * 10.0);
        let mut t = (self.lo / step).ceil() * step;
        let mut out = Vec::new();
        while t <= self.hi + step * 1e-9 {
            out.push(t);
            t += step;
        }
        out
    }
}

/// A plot area: its x and y scales and the rectangle they span.
#[derive(Debug, Clone, Copy)]
pub struct Frame {
    /// Horizontal scale.
    pub x: Scale,
    /// Vertical scale.
    pub y: Scale,
    /// Left edge, pixels.
    pub left: f64,
    /// Right edge.
    pub right: f64,
    /// Top edge.
    pub top: f64,
    /// Bottom edge.
    pub bottom: f64,
}

impl Frame {
    /// Draws the axes, grid lines at `x_ticks` and `y_ticks` with labels
    /// (`fx`, `fy` format a tick), and the axis titles.
    #[allow(clippy::too_many_arguments)]
    pub fn axes(
        &self,
        svg: &mut Svg,
        x_ticks: &[f64],
        y_ticks: &[f64],
        x_title: &str,
        y_title: &str,
        fx: &dyn Fn(f64) -> String,
        fy: &dyn Fn(f64) -> String,
    ) {
        let grid = Stroke::solid("#dddddd", 1.0);
        let axis = Stroke::solid("black", 1.0);
        for &t in y_ticks {
            let y = self.y.at(t);
            svg.line((self.left, y), (self.right, y), grid);
            svg.line((self.left - 4.0, y), (self.left, y), axis);
            svg.text(self.left - 7.0, y + 4.0, &fy(t), 11.0, Anchor::End, 0.0);
        }
        for &t in x_ticks {
            let x = self.x.at(t);
            svg.line((x, self.top), (x, self.bottom), grid);
            svg.line((x, self.bottom), (x, self.bottom + 4.0), axis);
            svg.text(x, self.bottom + 17.0, &fx(t), 11.0, Anchor::Middle, 0.0);
        }
        self.bare_axes(svg, x_title, y_title);
    }

    /// Draws the two axis lines and their titles only (for category x axes).
    pub fn bare_axes(&self, svg: &mut Svg, x_title: &str, y_title: &str) {
        let axis = Stroke::solid("black", 1.0);
        svg.line((self.left, self.bottom), (self.right, self.bottom), axis);
        svg.line((self.left, self.top), (self.left, self.bottom), axis);
        svg.text((self.left + self.right) / 2.0, self.bottom + 36.0, x_title, 12.0, Anchor::Middle, 0.0);
        let ym = (self.top + self.bottom) / 2.0;
        svg.text(self.left - 52.0, ym, y_title, 12.0, Anchor::Middle, -90.0);
    }
}

/// Distinct line colours, cycled.
pub const PALETTE: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_every_markup_character() {
        assert_eq!(escape(r#"a&b<c>"d"'e"#), "a&amp;b&lt;c&gt;&quot;d&quot;&#39;e");
    }

    #[test]
    fn log_scale_widens_to_decades_and_maps_by_log10() {
        // 3..700 widens to 1..1000: three decades over 300 px, 100 px each.
        let s = Scale::log(3.0, 700.0, 0.0, 300.0);
        assert_eq!(s.range(), (1.0, 1000.0));
        assert!((s.at(10.0) - 100.0).abs() < 1e-9);
        assert!((s.at(100.0) - 200.0).abs() < 1e-9);
        assert_eq!(s.ticks(), vec![1.0, 10.0, 100.0, 1000.0]);
    }

    #[test]
    fn linear_scale_maps_and_ticks_round_steps() {
        // 0..10 onto 400..0 (a y axis): 2.5 sits at 300.
        let s = Scale::linear(0.0, 10.0, 400.0, 0.0);
        assert!((s.at(2.5) - 300.0).abs() < 1e-9);
        assert_eq!(s.ticks(), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
    }

    #[test]
    fn document_is_standalone_svg_with_escaped_text() {
        let mut svg = Svg::new(100.0, 50.0, "a & b");
        svg.line((0.0, 0.0), (10.0, 10.0), Stroke::dashed("red", 1.0));
        svg.text(1.0, 2.0, "x<y", 10.0, Anchor::Start, 0.0);
        let doc = svg.finish();
        assert!(doc.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(doc.trim_end().ends_with("</svg>"));
        assert!(doc.contains("<title>a &amp; b</title>"));
        assert!(doc.contains("x&lt;y"));
        assert!(doc.contains(r#"stroke-dasharray="6 4""#));
    }
}
