//! `genpool report --html` rendered in headless Chromium: the page loads from disk, and the DOM Chromium
//! builds from it holds every series drawn with a non-trivial number of points (the tier areas, the
//! trace's live line, the lifetime bars); a screenshot is taken and checked to be a PNG.
//!
//! The page is also checked as text, with no browser; the rendering test needs Chromium (Debian:
//! `apt-get install -y chromium`; `$CHROMIUM` names the binary) and is `#[ignore]`d: `.ci/run` installs
//! Chromium and runs it with `--include-ignored`, where a missing browser is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in [
            "chromium",
            "chromium-browser",
            "google-chrome",
            "google-chrome-stable",
        ] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

fn headless(browser: &Path, profile: &Path, args: &[&str], page: &Path) -> std::process::Output {
    Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .output()
        .expect("run chromium")
}

/// The value of attribute `name` in the tag that starts at `tag`.
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let end = tag.find('>')?;
    let tag = &tag[..end];
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

/// Every element with `class="series"`: (data-series, data-points, points actually in the markup).
fn series(dom: &str) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let mut rest = dom;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        if attr(rest, "class") != Some("series") {
            continue;
        }
        let name = attr(rest, "data-series").unwrap_or_default().to_owned();
        let declared: usize = attr(rest, "data-points")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let drawn = if rest.starts_with("path") {
            // An area: the upper edge and the lower edge, one point each per sample.
            attr(rest, "d").map_or(0, |d| d.matches(['M', 'L']).count() / 2)
        } else if rest.starts_with("polyline") {
            attr(rest, "points").map_or(0, |p| p.split_whitespace().count())
        } else {
            // A group of bars: count its rects up to the group's end.
            let end = rest.find("</g>").unwrap_or(rest.len());
            rest[..end].matches("<rect").count()
        };
        out.push((name, declared, drawn));
    }
    out
}

/// Writes the report of the embedded trace into a fresh folder; returns (folder, page, its text).
fn write_page(tag: &str) -> (PathBuf, PathBuf, String) {
    let dir = std::env::temp_dir().join(format!("genpool-html-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let page = dir.join("report.html");
    let o = Command::new(env!("CARGO_BIN_EXE_genpool"))
        .args(["report", "--html"])
        .arg(&page)
        .args([
            "--every",
            "40",
            "--strategy",
            "native",
            "--strategy",
            "genpool",
        ])
        .output()
        .expect("run genpool");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(&page).unwrap();
    assert_eq!(
        html.matches("http").count(),
        html.matches(r#"xmlns="http://www.w3.org/2000/svg""#)
            .count(),
        "the page references nothing on the network"
    );
    assert!(!html.contains("<script"), "no script");
    (dir, page, html)
}

#[test]
fn html_report_is_self_contained_and_draws_every_bucket() {
    let (dir, _, html) = write_page("text");
    let s = series(&html);
    for name in [
        "reserved-extent",
        "reserved-trace-live",
        "reserved-total-min",
        "live-trace-live",
    ] {
        let (_, declared, drawn) = s
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("series {name} not drawn: {s:?}"));
        assert!(*declared > 600, "{name}: {declared} points declared");
        assert_eq!(drawn, declared, "{name}: drawn points");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs Chromium (apt-get install -y chromium, or $CHROMIUM); .ci/run installs it and runs this"]
fn html_report_renders_in_chromium() {
    let browser =
        chromium().expect("no chromium in PATH (apt-get install -y chromium) and no $CHROMIUM");
    let (dir, page, _) = write_page("chromium");
    let profile = dir.join("profile");
    let o = headless(&browser, &profile, &["--dump-dom"], &page);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dom = String::from_utf8(o.stdout).unwrap();
    let s = series(&dom);
    let get = |name: &str| {
        s.iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("series {name} not in the DOM: {s:?}"))
    };
    // 25,814 ops sampled every 40: 647 samples, every one drawn.
    for name in [
        "reserved-extent",
        "live-extent",
        "reserved-trace-live",
        "live-trace-live",
    ] {
        let (_, declared, drawn) = get(name);
        assert!(*declared > 600, "{name}: {declared} points declared");
        assert_eq!(drawn, declared, "{name}: drawn points");
    }
    for name in ["lifetime-short", "lifetime-mid"] {
        let (_, declared, drawn) = get(name);
        assert!(*declared >= 3, "{name}: {declared} bars");
        assert_eq!(drawn, declared, "{name}: bars in the DOM");
    }
    assert!(dom.contains("class=\"confusion\""), "confusion matrix");
    assert!(dom.contains("class=\"waste\""), "waste table");
    assert!(dom.contains("Recommendation."), "recommendation");

    let shot = dir.join("report.png");
    let o = headless(
        &browser,
        &profile,
        &[
            "--window-size=1040,2400",
            &format!("--screenshot={}", shot.display()),
        ],
        &page,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    assert!(
        png.len() > 20_000,
        "a non-blank screenshot: {} bytes",
        png.len()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
