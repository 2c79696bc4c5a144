//! End-to-end tests of the `genpool` binary: the embedded trace, the four original bundled traces (few passes),
//! `--json` output parsed, and malformed input (exit 2, one `genpool: file:line: ...` line on stderr).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn genpool(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_genpool"))
        .args(args)
        .output()
        .expect("run genpool")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

/// The real traces bundled in the repository: `$GENPOOL_TRACE_DIR`, else `<workspace>/benches/traces`.
fn bundled_traces() -> PathBuf {
    std::env::var_os("GENPOOL_TRACE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces"))
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

#[test]
fn embedded_trace_table() {
    let o = genpool(&[
        "replay",
        "--passes",
        "2",
        "--allocator",
        "bfc",
        "--allocator",
        "buddy",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.starts_with("resnet50_train: 25,814 ops (13,149 allocs, 12,665 frees), 1 stream, peak live 2.97 GiB, 2 passes"),
        "{out}"
    );
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[1].split_whitespace().eq([
        "allocator",
        "device",
        "peak",
        "reserved",
        "ratio",
        "ns/op"
    ]));
    for (line, name) in lines[2..4].iter().zip(["bfc", "buddy"]) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[0], name);
        assert_eq!(cols[1], "host");
        let ratio: f64 = cols[4].parse().unwrap();
        assert!((1.0..2.0).contains(&ratio), "{line}");
        let ns: f64 = cols[5].parse().unwrap();
        assert!(ns > 0.0, "{line}");
    }
    assert!(
        stderr(&o).is_empty(),
        "no progress bar when stderr is not a terminal"
    );
}

#[test]
fn json_output_has_the_issue_keys() {
    let o = genpool(&[
        "replay",
        "--json",
        "--passes",
        "3",
        "--ignore-site",
        "--allocator",
        "bfc",
        "--allocator",
        "buddy",
        "--device",
        "sim",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_lines(&o);
    assert_eq!(rows.len(), 2, "one object per trace and allocator");
    for (r, name) in rows.iter().zip(["bfc", "buddy"]) {
        assert_eq!(r["trace"], "resnet50_train");
        assert_eq!(r["allocator"], name);
        assert_eq!(r["ops"], 25_814);
        assert_eq!(r["passes"], 3);
        assert_eq!(r["ignore_site"], true);
        assert_eq!(r["ns_per_op_passes"].as_array().unwrap().len(), 2);
        let live = r["peak_live"].as_u64().unwrap();
        let reserved = r["peak_reserved"].as_u64().unwrap();
        assert!(reserved >= live);
        assert!((r["ratio"].as_f64().unwrap() - reserved as f64 / live as f64).abs() < 1e-12);
        assert!(r["ns_per_op"].as_f64().unwrap() > 0.0);
        assert!(r["tiers"].is_array());
        assert!(r.get("classifier").is_some());
        assert!(r.get("device").is_some());
    }
}

#[test]
fn every_original_trace_replays() {
    let dir = bundled_traces();
    assert!(
        dir.is_dir(),
        "bundled traces not found at {} (set GENPOOL_TRACE_DIR)",
        dir.display()
    );
    // The four original traces (benches/traces/README.md).
    let files: Vec<String> = [
        "gpt2_generate_kv",
        "gpt2_train_fixed",
        "gpt2m_train_varlen",
        "resnet50_train",
    ]
    .iter()
    .map(|n| {
        dir.join(format!("{n}.csv.gz"))
            .to_string_lossy()
            .into_owned()
    })
    .collect();
    // Debug builds replay ~20x slower: there one (instrumented) pass through one allocator; in release
    // two passes (one timed) through both.
    let mut args = vec!["replay", "--json"];
    let per_trace = if cfg!(debug_assertions) {
        args.extend(["--passes", "1", "--allocator", "buddy"]);
        1
    } else {
        args.extend([
            "--passes",
            "2",
            "--device",
            "sim",
            "--allocator",
            "genpool",
            "--allocator",
            "bfc",
        ]);
        2
    };
    args.extend(files.iter().map(String::as_str));
    let o = genpool(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_lines(&o);
    assert_eq!(rows.len(), 4 * per_trace);
    // peak live from traces/README.md.
    for (name, gib) in [
        ("gpt2_generate_kv", 0.84),
        ("gpt2_train_fixed", 12.66),
        ("gpt2m_train_varlen", 35.87),
        ("resnet50_train", 2.97),
    ] {
        let mine: Vec<_> = rows.iter().filter(|r| r["trace"] == name).collect();
        assert_eq!(mine.len(), per_trace, "{name}");
        for r in mine {
            let live = r["peak_live"].as_u64().unwrap() as f64 / (1u64 << 30) as f64;
            assert!((live - gib).abs() < 0.006, "{name}: {live}");
            assert!(r["ratio"].as_f64().unwrap() >= 1.0, "{r}");
        }
    }
}

fn tmp(name: &str, body: &str) -> PathBuf {
    // Under the build's own scratch folder (target/tmp), not the system's: nothing left behind in /tmp.
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

fn bad(name: &str, body: &str, expect: &str) {
    let p = tmp(name, body);
    let ps = p.to_string_lossy().into_owned();
    let o = genpool(&["replay", &ps, "--passes", "1"]);
    assert_eq!(o.status.code(), Some(2), "{name}: {}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "{err}");
    let want = format!("genpool: {ps}:{expect}");
    assert!(err.starts_with(&want), "{name}: got {err:?}, want {want:?}");
    assert!(stdout(&o).is_empty(), "nothing replayed before the error");
}

#[test]
fn malformed_files_exit_2_with_file_and_line() {
    let h = "t_us,action,addr,size,stream,site\n";
    bad(
        "action.csv",
        &format!("{h}1,a,512,512,0,0\n2,q,512,512,0,0\n"),
        "3: unknown action `q`",
    );
    bad(
        "number.csv",
        &format!("{h}1,a,0x200,512,0,0\n"),
        "2: addr: `0x200` is not",
    );
    bad(
        "dead.csv",
        &format!("{h}1,f,512,512,0,0\n"),
        "2: free of 0x200, which is not live",
    );
    bad(
        "twice.csv",
        &format!("{h}1,a,512,512,0,0\n1,a,512,512,0,0\n"),
        "3: allocation at 0x200, which is already live",
    );
    bad(
        "zero.csv",
        &format!("{h}1,a,512,0,0,0\n"),
        "2: allocation of size 0",
    );
    bad("noheader.csv", "1,a,512,512,0,0\n", "1: missing header");
    bad(
        "short.csv",
        &format!("{h}1,a,512\n"),
        "2: expected 6 fields",
    );
}

#[test]
fn a_bad_file_fails_before_any_replay() {
    let good = tmp(
        "good.csv",
        "t_us,action,addr,size,stream,site\n1,a,512,512,0,0\n",
    );
    let badp = tmp(
        "bad2.csv",
        "t_us,action,addr,size,stream,site\n1,z,512,512,0,0\n",
    );
    let o = genpool(&[
        "replay",
        "--json",
        &good.to_string_lossy(),
        &badp.to_string_lossy(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stdout(&o).is_empty());
}

#[test]
fn usage_errors() {
    let o = genpool(&["replay", "--allocator", "nope"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        "genpool: unknown allocator `nope` (known: genpool, genpool-single, genpool-generational, bfc, buddy)\n"
    );
    let o = genpool(&["replay", "--passes", "0"]);
    assert_eq!(o.status.code(), Some(2));
    let o = genpool(&["replay", "--device", "tpu"]);
    assert_eq!(o.status.code(), Some(2));
    let o = genpool(&["replay", "/definitely/not/here.csv"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).starts_with("genpool: /definitely/not/here.csv: cannot open"));
    let o = genpool(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("replay"));
}

/// The main job of the README: with no arguments, the embedded trace through the engine.
#[test]
fn default_replays_the_engine_on_the_embedded_trace() {
    let o = genpool(&["replay", "--device", "sim", "--passes", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_lines(&o);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["allocator"], "genpool");
    assert_eq!(rows[0]["trace"], "resnet50_train");
    let ratio = rows[0]["ratio"].as_f64().unwrap();
    assert!((1.0..1.10).contains(&ratio), "ratio {ratio}");
    let tiers = rows[0]["tiers"].as_array().unwrap();
    assert_eq!(tiers.len(), 4);
    // The default routes by size: no prediction is made, so none is reported; routing by predicted
    // lifetime (`genpool-generational`) reports its accuracy.
    assert!(rows[0]["classifier"].is_null(), "{}", rows[0]["classifier"]);
    let o = genpool(&[
        "replay",
        "--device",
        "sim",
        "--passes",
        "2",
        "--json",
        "--allocator",
        "genpool-generational",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows = json_lines(&o);
    assert_eq!(rows[0]["allocator"], "genpool-generational");
    assert!(rows[0]["classifier"]["accuracy_count"].as_f64().unwrap() > 0.5);
}

/// `genpool analyze` names the dominant cause of waste at the peak, in the table and in `--json`:
/// on an interleaved pattern (ten 2 MiB blocks, every other one freed, then 4 MiB blocks that fit
/// none of the holes) PyTorch's native allocator wastes exactly the holes, as split fragments.
#[test]
fn analyze_names_the_dominant_waste() {
    const MIB: u64 = 1 << 20;
    let mut csv = String::from("t_us,action,addr,size,stream,site\n");
    let mut t = 0;
    let mut line = |action: &str, id: u64, size: u64| {
        t += 1;
        csv.push_str(&format!("{t},{action},{},{size},0,0\n", (id + 1) << 32));
    };
    for i in 0..10 {
        line("a", i, 2 * MIB);
    }
    for i in (0..10).step_by(2) {
        line("f", i, 2 * MIB);
    }
    for i in 10..15 {
        line("a", i, 4 * MIB);
    }
    let p = tmp("interleaved.csv", &csv);
    let ps = p.to_string_lossy().into_owned();
    let args = [
        "analyze",
        &ps,
        "--strategy",
        "native",
        "--strategy",
        "expandable",
    ];
    let o = genpool(&[&args[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let v = &json_lines(&o)[0];
    let native = &v["results"][0];
    assert_eq!(native["strategy"], "native");
    assert_eq!(native["dominant_waste"], "split_fragments", "{native}");
    assert_eq!(native["waste"]["split_fragments"], 10 * MIB, "{native}");
    assert_eq!(native["at_peak"]["live"], 30 * MIB, "{native}");
    assert_eq!(native["at_peak"]["reserved"], 40 * MIB, "{native}");
    let expandable = &v["results"][1];
    assert_eq!(expandable["dominant_waste"], "free_holes", "{expandable}");
    let o = genpool(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("dominant waste at peak"), "{text}");
    assert!(text.contains("split_fragments 100 %"), "{text}");
    assert!(
        text.contains("native       10.00 MiB of 40.00 MiB: split_fragments 10.00 MiB (100 %)"),
        "{text}"
    );
}

fn genpool_with_conf(conf: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_genpool"))
        .env("GENPOOL_CONF", conf)
        .args(args)
        .output()
        .expect("run genpool")
}

/// `GENPOOL_CONF` configures the engine in every command: an unknown key is the same error (exit 1,
/// naming the key, before any work) in `replay`, `analyze` and `report` (Markdown and HTML).
#[test]
fn every_command_refuses_an_unknown_genpool_conf_key() {
    let html = std::env::temp_dir().join(format!("genpool-conf-{}.html", std::process::id()));
    let html = html.to_str().unwrap();
    let mut first: Option<String> = None;
    for args in [
        &["replay", "--passes", "1"][..],
        &["analyze", "--strategy", "genpool"],
        &["report", "--strategy", "genpool"],
        &["report", "--html", html],
    ] {
        let o = genpool_with_conf("bogus:1", args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains("GENPOOL_CONF") && err.contains("bogus"),
            "{args:?}: {err}"
        );
        assert!(
            stdout(&o).is_empty(),
            "{args:?}: no output before the error"
        );
        match &first {
            None => first = Some(err),
            Some(f) => assert_eq!(&err, f, "{args:?}: the same error as replay's"),
        }
    }
    assert!(!Path::new(html).exists(), "no page written");
}

/// `GENPOOL_CONF` is honoured, not only checked: a smaller slab limit moves blocks out of the slab in
/// `analyze`'s engine run, so its peak reservation differs from the default's.
#[test]
fn analyze_honours_genpool_conf() {
    let run = |conf: &str| {
        let o = genpool_with_conf(conf, &["analyze", "--json", "--strategy", "genpool"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        v["results"][0]["peak_reserved"].as_u64().unwrap()
    };
    let default = run("");
    assert_ne!(
        run("experimental.routing:generational"),
        default,
        "experimental.routing:generational changes the engine's layout"
    );
}

/// `report` says where it wrote, and an unwritable output is an error naming the path.
#[test]
fn report_says_where_it_wrote_and_names_a_bad_path() {
    let dir = std::env::temp_dir().join(format!("genpool-where-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let md = dir.join("r.md");
    let o = genpool(&[
        "report",
        "--strategy",
        "native",
        "--out",
        md.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&md.display().to_string()),
        "{}",
        stderr(&o)
    );
    assert!(md.is_file());
    let bad = dir.join("no-such-dir").join("r.html");
    let o = genpool(&["report", "--html", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&bad.display().to_string()),
        "{}",
        stderr(&o)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The replay table explains its per-tier figures: own peaks (footnoted) and allocations per pass.
#[test]
fn replay_table_shows_per_pass_counts_and_own_peaks() {
    let o = genpool(&["replay", "--passes", "2", "--device", "sim"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("own peak reserved"), "{out}");
    assert!(out.contains("allocs a pass*"), "{out}");
    assert!(out.contains("need not add up to the total"), "{out}");
    // The embedded trace has 13,149 allocations: the tiers' counts per pass add up to about that.
    let per_pass: f64 = out
        .lines()
        .filter(|l| l.trim_start().starts_with("tier "))
        .map(|l| {
            let n = l.split(", ").nth(1).unwrap().split(' ').next().unwrap();
            n.replace(',', "").parse::<f64>().unwrap()
        })
        .sum();
    assert!((per_pass - 13_149.0).abs() < 1.0, "{per_pass}: {out}");
}

#[test]
fn synth_writes_traces_that_replay_and_refuses_unknown_shapes() {
    let dir = std::env::temp_dir().join(format!("genpool_synth_{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let o = genpool(&["synth", d, "crossfree", "serve8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 2, "{}", stdout(&o));
    let f = dir.join("serve8.csv.gz");
    let o = genpool(&["replay", f.to_str().unwrap(), "--passes", "2", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j = &json_lines(&o)[0];
    assert_eq!(j["trace"], "serve8");
    assert!(j["ratio"].as_f64().unwrap() < 1.05, "{j}");
    // An unknown shape: exit 2, nothing written.
    let o = genpool(&["synth", d, "kvgrow", "nope"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("unknown shape `nope`"),
        "{}",
        stderr(&o)
    );
    assert!(!dir.join("kvgrow.csv.gz").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
