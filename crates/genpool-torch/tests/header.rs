//! The committed C header `include/genpool.h` matches the functions `src/abi.rs` and `src/backend_abi.rs` export.
//!
//! Always: the set of `genpool_*` functions declared in the header equals the set of `#[no_mangle]`
//! functions in the source. When `cbindgen` is on `PATH`: the header is byte-identical to a fresh
//! generation. When a C compiler (`cc`) is on `PATH`: the header compiles as C and C++ with `-Werror`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn header_path() -> PathBuf {
    crate_dir().join("include/genpool.h")
}

/// The sources that export C functions: the pluggable hooks, the backend's, tags (sleep, wake), CUDA
/// graphs (captures, checkpoints), CUDA IPC and peers.
const ABI_SOURCES: [&str; 5] = [
    "src/abi.rs",
    "src/backend_abi.rs",
    "src/sleep_abi.rs",
    "src/graphs.rs",
    "src/ipc.rs",
];

fn exported_in_source() -> BTreeSet<String> {
    let src: String = ABI_SOURCES
        .iter()
        .map(|f| std::fs::read_to_string(crate_dir().join(f)).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let lines: Vec<&str> = src.lines().map(str::trim).collect();
    let mut names = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let rest = line
            .strip_prefix("pub extern \"C\" fn ")
            .or_else(|| line.strip_prefix("pub unsafe extern \"C\" fn "));
        if let Some(rest) = rest {
            let name = rest.split('(').next().unwrap().to_string();
            assert_eq!(lines[i - 1], "#[no_mangle]", "{name} must be #[no_mangle]");
            names.insert(name);
        }
    }
    names
}

fn declared_in_header(header: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in header.lines().map(str::trim) {
        if line.starts_with('*')
            || line.starts_with("/*")
            || line.starts_with("//")
            || line.starts_with('#')
        {
            continue;
        }
        if let Some(at) = line.find("genpool_") {
            let tail = &line[at..];
            if let Some(paren) = tail.find('(') {
                let name = &tail[..paren];
                if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    names.insert(name.to_string());
                }
            }
        }
    }
    names
}

#[test]
fn header_declares_exactly_the_exported_functions() {
    let header = std::fs::read_to_string(header_path()).expect("include/genpool.h is committed");
    let source = exported_in_source();
    assert!(
        source.contains("genpool_malloc") && source.contains("genpool_free"),
        "{source:?}"
    );
    assert_eq!(
        declared_in_header(&header),
        source,
        "regenerate include/genpool.h (see cbindgen.toml)"
    );
    assert!(header.contains("typedef struct CUstream_st *cudaStream_t;"));
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
#[ignore = "needs cbindgen on PATH (cargo install cbindgen); the symbol check runs without it"]
fn header_is_byte_identical_to_cbindgen_output() {
    assert!(
        have("cbindgen"),
        "cbindgen not on PATH (cargo install cbindgen)"
    );
    let out = std::env::temp_dir().join(format!("genpool-header-{}.h", std::process::id()));
    let status = Command::new("cbindgen")
        .current_dir(crate_dir())
        .args([
            "--config",
            "cbindgen.toml",
            "--crate",
            "genpool-torch",
            "--output",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success(), "cbindgen failed");
    let fresh = std::fs::read_to_string(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    let committed = std::fs::read_to_string(header_path()).unwrap();
    assert!(
        fresh == committed,
        "include/genpool.h is stale: regenerate it (see cbindgen.toml)"
    );
}

fn compile(compiler: &str, lang: &str, header_dir: &Path) {
    let dir = std::env::temp_dir().join(format!("genpool-header-cc-{}-{lang}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(if lang == "c" { "t.c" } else { "t.cpp" });
    // Use every declaration with the types PyTorch's hook passes.
    std::fs::write(
        &file,
        "#include \"genpool.h\"\n\
         typedef struct CUstream_st *cudaStream_t; /* as <driver_types.h> would */\n\
         int main(void) {\n\
           char buf[64];\n\
           cudaStream_t s = 0;\n\
           void *p = genpool_malloc(512, 0, s);\n\
           genpool_record_stream(p, s);\n\
           genpool_free(p, 512, 0, s);\n\
           genpool_init(1); genpool_reset(); genpool_set_memory_fraction(0.5, 0);\n\
           size_t n = genpool_stats_json(0, buf, sizeof buf) + genpool_last_error(buf, sizeof buf);\n\
           uint64_t t = genpool_trim(0); genpool_mark_iteration(0);\n\
           int r = genpool_tag_set(\"weights\") + genpool_sleep(\"weights,default\", GENPOOL_SLEEP_OFFLOAD)\n\
             + genpool_wake(NULL, 0) + (genpool_tag_set(NULL) == GENPOOL_ERR_INVALID);\n\
           n += genpool_tags_json(buf, sizeof buf);\n\
           return (int)(n + t) + r;\n\
         }\n",
    )
    .unwrap();
    let out = Command::new(compiler)
        .args(["-fsyntax-only", "-Wall", "-Wextra", "-Werror"])
        .args(if lang == "c" {
            ["-std=c11", "-xc"]
        } else {
            ["-std=c++17", "-xc++"]
        })
        .arg("-I")
        .arg(header_dir)
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{compiler} ({lang}): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `cc` is the C compiler Rust links with on Linux: its absence is a failure, not a skip.
#[test]
fn header_compiles_as_c() {
    assert!(have("cc"), "no C compiler `cc` on PATH");
    compile("cc", "c", &crate_dir().join("include"));
}

#[test]
#[ignore = "needs a C++ compiler `c++` on PATH; .ci/run runs it"]
fn header_compiles_as_cpp() {
    assert!(have("c++"), "no C++ compiler `c++` on PATH");
    compile("c++", "cpp", &crate_dir().join("include"));
}
