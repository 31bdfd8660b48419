//! A loss curve as a standalone SVG (training loss per step, validation points).

/// Stated in every loss curve: a run replaces an existing SVG only when it holds this.
pub const OWN_MARK: &str = "loss curve written by megatrain";

/// SVG text of `train` (step, loss) and `val` (step, loss) points.
pub fn loss_svg(train: &[(u64, f64)], val: &[(u64, f64)], title: &str) -> String {
    let (w, h, pad) = (800.0, 480.0, 60.0);
    let pts: Vec<(u64, f64)> = train
        .iter()
        .chain(val)
        .copied()
        .filter(|p| p.1.is_finite())
        .collect();
    let (x0, x1) = (
        pts.iter().map(|p| p.0).min().unwrap_or(0) as f64,
        pts.iter().map(|p| p.0).max().unwrap_or(1).max(1) as f64,
    );
    let (y0, y1) = (
        pts.iter()
            .map(|p| p.1)
            .fold(f64::INFINITY, f64::min)
            .min(f64::MAX),
        pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max),
    );
    let (y0, y1) = if y1 > y0 {
        (y0, y1)
    } else {
        (y0 - 1.0, y0 + 1.0)
    };
    let sx = |x: f64| pad + (x - x0) / (x1 - x0).max(1.0) * (w - 2.0 * pad);
    let sy = |y: f64| h - pad - (y - y0) / (y1 - y0) * (h - 2.0 * pad);
    let line: Vec<String> = train
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|p| format!("{:.1},{:.1}", sx(p.0 as f64), sy(p.1)))
        .collect();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <desc>{OWN_MARK}</desc>\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n\
         <line x1=\"{pad}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n\
         <line x1=\"{pad}\" y1=\"{pad}\" x2=\"{pad}\" y2=\"{}\" stroke=\"black\"/>\n\
         <text x=\"{pad}\" y=\"{}\" text-anchor=\"middle\">{x0}</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{x1}</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{y1:.3}</text>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"end\">{y0:.3}</text>\n\
         <polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        w / 2.0,
        title.replace('<', "&lt;").replace('&', "&amp;"),
        h - pad,
        w - pad,
        h - pad,
        h - pad,
        h - pad + 18.0,
        w - pad,
        h - pad + 18.0,
        w / 2.0,
        h - 12.0,
        pad - 6.0,
        pad + 4.0,
        pad - 6.0,
        h - pad,
        line.join(" ")
    );
    for p in val.iter().filter(|p| p.1.is_finite()) {
        s += &format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" fill=\"#d62728\"/>\n",
            sx(p.0 as f64),
            sy(p.1)
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" fill=\"#1f77b4\">— train loss</text>\n<text x=\"{}\" y=\"{}\" fill=\"#d62728\">● validation loss</text>\n</svg>\n",
        w - pad - 150.0,
        pad + 10.0,
        w - pad - 150.0,
        pad + 28.0
    );
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn svg_has_the_curve() {
        let s = super::loss_svg(&[(1, 5.0), (2, 4.0), (3, 3.5)], &[(3, 3.7)], "t");
        assert!(s.starts_with("<svg") && s.contains("<polyline") && s.contains("<circle"));
        assert!(s[..200].contains(super::OWN_MARK));
    }
}
