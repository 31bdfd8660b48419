//! The host build of a kernel program: the same CUDA source NVRTC compiled, compiled again by
//! the host C++ compiler against the SIMT runtime (`simt/`), and loaded.
//!
//! Before compiling, each `__shared__` declaration is rewritten into a reference to the block's
//! shared memory (a static array into the runtime's per-block arena, `extern __shared__` into
//! the launch's dynamic part), and one trampoline per `.entry` of the real PTX is appended: it
//! unpacks CUDA's `kernelParams` array by the kernel's own parameter types, and describes them
//! (pointer to const, pointer to writable, scalar size) so every launch knows what it reads and
//! writes. Builds are cached under `CUEMU_CACHE`, keyed by a hash of everything they depend on.

use crate::ptx::PtxInfo;
use crate::{config, report, simt};
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Element type behind a pointer parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    Bf16,
    F16,
    /// Integers of this many bytes, or untyped memory (1).
    Int(usize),
}

impl Elem {
    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F64 => 8,
            Elem::Bf16 | Elem::F16 => 2,
            Elem::Int(n) => n,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A pointer to const memory.
    Read(Elem),
    /// A pointer to memory the kernel may write.
    Write(Elem),
    /// A value of this many bytes.
    Scalar(usize),
}

#[derive(Debug)]
pub struct Kernel {
    pub name: String,
    pub run: simt::KernelFn,
    pub params: Vec<Param>,
    /// Bytes of each parameter per the PTX.
    pub sizes: Vec<usize>,
    pub static_shared: usize,
}

#[derive(Debug)]
pub struct Program {
    pub ptx: PtxInfo,
    pub kernels: Vec<Kernel>,
}

/// FNV-1a, 64 bits: the cache key and the image fingerprint.
pub fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn images() -> std::sync::MutexGuard<'static, HashMap<u64, Arc<Program>>> {
    static I: OnceLock<Mutex<HashMap<u64, Arc<Program>>>> = OnceLock::new();
    I.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Remember that module image `bytes` (PTX or CUBIN) is `program`.
pub fn register_image(bytes: &[u8], program: Arc<Program>) {
    images().insert(fnv(&[bytes]), program);
}

/// The program a module image came from: compiled by the emulated NVRTC in this process, or in
/// an earlier one whose recipe ([`keep_recipe`]) is in the cache — as a real driver runs a CUBIN
/// a program kept on disk from an earlier run.
pub fn program_for_image(bytes: &[u8]) -> Option<Arc<Program>> {
    let key = fnv(&[bytes]);
    if let Some(p) = images().get(&key).cloned() {
        return Some(p);
    }
    let r = read_recipe(&recipe_path(key))?;
    let info = crate::ptx::parse(&r.ptx).ok()?;
    match build(&r.name, &r.source, &r.headers, &r.options, info) {
        Ok(program) => {
            register_image(bytes, program.clone());
            Some(program)
        }
        Err(e) => {
            report::error(
                "host build failed",
                &format!("{} (from its recipe): {e}", r.name),
            );
            None
        }
    }
}

/// What the host build of an image needs: the program as NVRTC got it, and its PTX.
pub struct Recipe {
    pub name: String,
    pub source: String,
    pub headers: Vec<(String, String)>,
    pub options: Vec<String>,
    pub ptx: String,
}

fn recipe_path(image_key: u64) -> PathBuf {
    config::get()
        .cache
        .join("images")
        .join(format!("{image_key:016x}.recipe"))
}

/// Keep the recipe of `images` (a program's PTX and CUBIN) in the cache, so a later process that
/// loads them without compiling (megatrain's kernel cache) still finds their host build. Best
/// effort: a cache that cannot be written only loses that.
pub fn keep_recipe(images: &[&[u8]], r: &Recipe) {
    let mut b = Vec::new();
    let mut field = |x: &[u8]| {
        b.extend_from_slice(&(x.len() as u64).to_le_bytes());
        b.extend_from_slice(x);
    };
    field(b"cuemu-recipe-1");
    field(r.name.as_bytes());
    field(r.source.as_bytes());
    field(r.ptx.as_bytes());
    field(&(r.headers.len() as u64).to_le_bytes());
    for (n, t) in &r.headers {
        field(n.as_bytes());
        field(t.as_bytes());
    }
    field(&(r.options.len() as u64).to_le_bytes());
    for o in &r.options {
        field(o.as_bytes());
    }
    for image in images {
        let dest = recipe_path(fnv(&[image]));
        if dest.is_file() {
            continue;
        }
        let Some(dir) = dest.parent() else {
            continue;
        };
        if std::fs::create_dir_all(dir).is_err() {
            continue;
        }
        let tmp = dir.join(format!(".tmp-{}-{:p}", std::process::id(), image.as_ptr()));
        if std::fs::write(&tmp, &b).is_ok() && publish(&tmp, &dest).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

fn read_recipe(path: &Path) -> Option<Recipe> {
    let b = std::fs::read(path).ok()?;
    let mut at = 0usize;
    let mut field = || -> Option<&[u8]> {
        let n = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
        let n = usize::try_from(n).ok()?;
        let end = at.checked_add(8)?.checked_add(n)?;
        let x = b.get(at + 8..end)?;
        at = end;
        Some(x)
    };
    let text = |x: &[u8]| String::from_utf8(x.to_vec()).ok();
    let count = |x: &[u8]| -> Option<usize> {
        usize::try_from(u64::from_le_bytes(x.try_into().ok()?)).ok()
    };
    if field()? != b"cuemu-recipe-1" {
        return None;
    }
    let name = text(field()?)?;
    let source = text(field()?)?;
    let ptx = text(field()?)?;
    let nh = count(field()?)?;
    let mut headers = Vec::new();
    for _ in 0..nh.min(1 << 16) {
        headers.push((text(field()?)?, text(field()?)?));
    }
    let no = count(field()?)?;
    let mut options = Vec::new();
    for _ in 0..no.min(1 << 16) {
        options.push(text(field()?)?);
    }
    Some(Recipe {
        name,
        source,
        headers,
        options,
        ptx,
    })
}

const SIMT_H: &str = "cuemu_simt.h";
const ABI_H: &str = "cuemu_abi.h";
const RUNTIME: &str = "runtime.cpp";

fn read(dir: &Path, f: &str) -> Result<String, String> {
    std::fs::read_to_string(dir.join(f)).map_err(|e| {
        format!(
            "cannot read {} ({e}); CUEMU_SIMT must name tools/cuemu/simt",
            dir.join(f).display()
        )
    })
}

fn compile(args: &[String], what: &str) -> Result<(), String> {
    let cxx = &config::get().cxx;
    let t0 = std::time::Instant::now();
    let out = std::process::Command::new(cxx)
        .args(args)
        .output()
        .map_err(|e| {
            format!("cannot run the host C++ compiler `{cxx}` ({e}); install g++ or set CUEMU_CXX")
        })?;
    if !out.status.success() {
        return Err(format!(
            "the host build of {what} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    report::note(&format!(
        "built {what} for the host in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// Move a finished build into place (atomically: concurrent builds of one key both succeed).
fn publish(tmp: &Path, dest: &Path) -> Result<(), String> {
    std::fs::rename(tmp, dest).map_err(|e| format!("cannot move {} into place: {e}", tmp.display()))
}

/// The SIMT runtime library (built once per runtime source).
pub fn simt_library() -> Result<PathBuf, String> {
    static LIB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let c = config::get();
        let (runtime, abi) = (read(&c.simt, RUNTIME)?, read(&c.simt, ABI_H)?);
        let key = fnv(&[runtime.as_bytes(), abi.as_bytes(), c.cxx.as_bytes()]);
        let dir = c.cache.join(format!("simt-{key:016x}"));
        let lib = dir.join("libcuemu_simt.so");
        if !lib.is_file() {
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            let tmp = dir.join(format!(".tmp-{}.so", std::process::id()));
            compile(
                &[
                    "-std=c++17".into(),
                    "-O2".into(),
                    "-fPIC".into(),
                    "-shared".into(),
                    format!("-I{}", c.simt.display()),
                    "-o".into(),
                    tmp.display().to_string(),
                    c.simt.join(RUNTIME).display().to_string(),
                ],
                "the SIMT runtime",
            )?;
            publish(&tmp, &lib)?;
        }
        Ok(lib)
    })
    .clone()
}

/// NVRTC options that matter to the host build.
struct Options {
    includes: Vec<String>,
    defines: Vec<String>,
    fmad: bool,
    std: String,
}

fn options(opts: &[String]) -> Options {
    let mut o = Options {
        includes: Vec::new(),
        defines: Vec::new(),
        fmad: true,
        std: "c++17".into(),
    };
    let mut it = opts.iter().peekable();
    while let Some(a) = it.next() {
        if let Some(p) = a
            .strip_prefix("--include-path=")
            .or_else(|| a.strip_prefix("-I").filter(|p| !p.is_empty()))
        {
            o.includes.push(p.to_owned());
        } else if a == "-I" || a == "--include-path" {
            if let Some(p) = it.next() {
                o.includes.push(p.clone());
            }
        } else if let Some(d) = a
            .strip_prefix("--define-macro=")
            .or_else(|| a.strip_prefix("-D").filter(|d| !d.is_empty()))
        {
            o.defines.push(d.to_owned());
        } else if let Some(v) = a
            .strip_prefix("--fmad=")
            .or_else(|| a.strip_prefix("-fmad="))
        {
            o.fmad = v == "true";
        } else if let Some(v) = a.strip_prefix("--std=").or_else(|| a.strip_prefix("-std=")) {
            o.std = v.to_owned();
        }
    }
    o
}

/// Rewrite every `__shared__` declaration of `src` for the host (see the module docs). Lines
/// are kept, so compiler messages point at the original source.
pub fn rewrite_shared(src: &str) -> Result<String, String> {
    const KW: &str = "__shared__";
    let mut out = String::with_capacity(src.len() + 1024);
    let mut rest = src;
    let mut n = 0;
    while let Some(i) = rest.find(KW) {
        let before = &rest[..i];
        let ident_before = before
            .chars()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        let after = &rest[i + KW.len()..];
        if ident_before || after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            out.push_str(&rest[..i + KW.len()]);
            rest = after;
            continue;
        }
        // `extern` right before?
        let trimmed = before.trim_end_matches([' ', '\t']);
        let (keep, is_extern) = match trimmed.strip_suffix("extern") {
            Some(k) if !k.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') => (k, true),
            _ => (before, false),
        };
        let end = after
            .find(';')
            .ok_or_else(|| "a __shared__ declaration without `;`".to_owned())?;
        let decl = after[..end].trim();
        let line = src[..src.len() - rest.len() + i].matches('\n').count() + 1;
        if decl.contains(',') || decl.contains('=') || decl.contains('\n') {
            return Err(format!(
                "line {line}: `__shared__ {decl};` is not emulated (one declarator, no initialiser, on one line)"
            ));
        }
        let (head, dims) = match decl.find('[') {
            Some(b) => (decl[..b].trim_end(), decl[b..].trim()),
            None => (decl, ""),
        };
        let name_at = head
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |p| p + 1);
        let (ty, name) = (head[..name_at].trim(), &head[name_at..]);
        if ty.is_empty() || name.is_empty() {
            return Err(format!("line {line}: cannot parse `__shared__ {decl};`"));
        }
        n += 1;
        out.push_str(keep);
        if is_extern {
            out.push_str(&format!(
                "{ty}* {name} = reinterpret_cast<{ty}*>(::cuemu_shared_dynamic())"
            ));
        } else if dims.is_empty() {
            out.push_str(&format!(
                "static char cuemu_tag_{n}; {ty}& {name} = *reinterpret_cast<{ty}*>(::cuemu_shared_static(&cuemu_tag_{n}, sizeof({ty}), alignof({ty}), {line}))"
            ));
        } else {
            out.push_str(&format!(
                "static char cuemu_tag_{n}; {ty} (&{name}){dims} = *reinterpret_cast<{ty} (*){dims}>(::cuemu_shared_static(&cuemu_tag_{n}, sizeof({ty}{dims}), alignof({ty}), {line}))"
            ));
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The trampolines and the kernel table appended to a program.
fn trampolines(ptx: &PtxInfo) -> Result<String, String> {
    let mut s = String::from("\n// ---- cuemu: trampolines ----\n");
    for (i, e) in ptx.entries.iter().enumerate() {
        if !e
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
            || e.name.starts_with("_Z")
        {
            return Err(format!(
                "kernel `{}` is not extern \"C\": cuemu runs kernels it can name (declare them extern \"C\")",
                e.name
            ));
        }
        s.push_str(&format!(
            "static void cuemu_run_{i}(void** p) {{ cuemu_detail::invoke(&{n}, p); }}\n\
             static const char* cuemu_sig_{i}() {{ return cuemu_detail::signature(&{n}); }}\n",
            n = e.name
        ));
    }
    s.push_str("extern \"C\" __attribute__((visibility(\"default\"))) const cuemu_kernel_entry cuemu_kernels[] = {\n");
    for (i, e) in ptx.entries.iter().enumerate() {
        s.push_str(&format!(
            "    {{\"{}\", cuemu_run_{i}, cuemu_sig_{i}}},\n",
            e.name
        ));
    }
    if ptx.entries.is_empty() {
        s.push_str("    {nullptr, nullptr, nullptr},\n");
    }
    s.push_str(&format!(
        "}};\nextern \"C\" __attribute__((visibility(\"default\"))) const unsigned cuemu_kernel_count = {};\n",
        ptx.entries.len()
    ));
    Ok(s)
}

fn parse_signature(kernel: &str, sig: &str) -> Result<Vec<Param>, String> {
    sig.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (kind, ty) = p
                .split_once(':')
                .ok_or_else(|| format!("{kernel}: bad parameter description `{p}`"))?;
            let elem = match ty {
                "f32" => Elem::F32,
                "f64" => Elem::F64,
                "bf16" => Elem::Bf16,
                "f16" => Elem::F16,
                "i8" | "u8" | "b" => Elem::Int(1),
                "i16" | "u16" => Elem::Int(2),
                "i32" | "u32" => Elem::Int(4),
                "i64" | "u64" => Elem::Int(8),
                n => {
                    return match kind {
                        "s" => n
                            .parse()
                            .map(Param::Scalar)
                            .map_err(|_| format!("{kernel}: bad size `{n}`")),
                        _ => Err(format!("{kernel}: unknown element type `{n}`")),
                    }
                }
            };
            Ok(match kind {
                "r" => Param::Read(elem),
                "w" => Param::Write(elem),
                _ => Param::Scalar(elem.bytes()),
            })
        })
        .collect()
}

/// Build (or find in the cache) and load the host version of one NVRTC program.
pub fn build(
    name: &str,
    source: &str,
    headers: &[(String, String)],
    nvrtc_options: &[String],
    ptx: PtxInfo,
) -> Result<Arc<Program>, String> {
    let c = config::get();
    let simt_lib = simt_library()?;
    let simt_h = read(&c.simt, SIMT_H)?;
    let o = options(nvrtc_options);
    let mut program = rewrite_shared(source).map_err(|e| format!("{name}: {e}"))?;
    program.push_str(&trampolines(&ptx)?);
    let mut header_texts = Vec::new();
    for (n, t) in headers {
        header_texts.push((
            n.clone(),
            rewrite_shared(t).map_err(|e| format!("{n}: {e}"))?,
        ));
    }
    let fma = o.fmad && std::is_x86_feature_detected!("fma");
    let mut key_parts: Vec<&[u8]> = vec![
        simt_h.as_bytes(),
        program.as_bytes(),
        o.std.as_bytes(),
        c.cxx.as_bytes(),
        if fma { b"fma" } else { b"nofma" },
    ];
    for (n, t) in &header_texts {
        key_parts.push(n.as_bytes());
        key_parts.push(t.as_bytes());
    }
    for d in &o.defines {
        key_parts.push(d.as_bytes());
    }
    let simt_path = simt_lib.display().to_string();
    key_parts.push(simt_path.as_bytes());
    let key = fnv(&key_parts);
    let dir = c.cache.join("programs");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let lib = dir.join(format!("prog-{key:016x}.so"));
    if !lib.is_file() {
        let work = dir.join(format!(".build-{key:016x}-{}", std::process::id()));
        std::fs::create_dir_all(&work)
            .map_err(|e| format!("cannot create {}: {e}", work.display()))?;
        let src_name = format!("{}.cpp", name.replace(['/', ' '], "_"));
        std::fs::write(
            work.join(&src_name),
            format!("#line 1 \"{name}\"\n{program}"),
        )
        .map_err(|e| format!("cannot write the host source: {e}"))?;
        for (n, t) in &header_texts {
            let p = work.join(n);
            if let Some(parent) = p.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            std::fs::write(&p, t).map_err(|e| format!("cannot write header {n}: {e}"))?;
        }
        let simt_dir = simt_lib.parent().unwrap_or(Path::new("."));
        let tmp = work.join("prog.so");
        let mut args = vec![
            format!("-std={}", o.std),
            "-O2".into(),
            "-fPIC".into(),
            "-shared".into(),
            "-w".into(),
            "-fno-strict-aliasing".into(),
            if fma {
                "-ffp-contract=fast".into()
            } else {
                "-ffp-contract=off".into()
            },
            "-include".into(),
            c.simt.join(SIMT_H).display().to_string(),
            format!("-I{}", c.simt.display()),
            format!("-I{}", work.display()),
        ];
        if fma {
            args.push("-mfma".into());
        }
        for i in o
            .includes
            .iter()
            .map(PathBuf::from)
            .chain(c.include.iter().cloned())
        {
            args.push(format!("-I{}", i.display()));
        }
        for d in &o.defines {
            args.push(format!("-D{d}"));
        }
        args.extend([
            "-o".into(),
            tmp.display().to_string(),
            work.join(&src_name).display().to_string(),
            format!("-L{}", simt_dir.display()),
            "-l:libcuemu_simt.so".into(),
            format!("-Wl,-rpath,{}", simt_dir.display()),
        ]);
        let built = compile(&args, &format!("kernel program {name}"));
        let moved = built.and_then(|()| publish(&tmp, &lib));
        let _ = std::fs::remove_dir_all(&work);
        moved?;
    }
    load(name, &lib, ptx)
}

fn load(name: &str, lib: &Path, ptx: PtxInfo) -> Result<Arc<Program>, String> {
    simt::runtime()?;
    let path = CString::new(lib.display().to_string()).map_err(|_| "path with NUL".to_owned())?;
    // SAFETY: dlopen of a library we built; it stays loaded for the process.
    let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(format!("cannot load {}: {}", lib.display(), dlerror()));
    }
    // SAFETY: symbols the generated code defines with these types.
    let (table, count) = unsafe {
        let t = libc::dlsym(h, c"cuemu_kernels".as_ptr()) as *const simt::KernelEntry;
        let n = libc::dlsym(h, c"cuemu_kernel_count".as_ptr()) as *const u32;
        if t.is_null() || n.is_null() {
            return Err(format!("{} lacks the kernel table", lib.display()));
        }
        (t, *n as usize)
    };
    let mut kernels = Vec::with_capacity(count);
    for (i, e) in ptx.entries.iter().enumerate().take(count) {
        // SAFETY: `count` entries, generated in PTX order.
        let entry = unsafe { &*table.add(i) };
        // SAFETY: the generated signature function returns a NUL-terminated static buffer.
        let sig = unsafe { CStr::from_ptr((entry.signature)()) }
            .to_string_lossy()
            .into_owned();
        let params = parse_signature(&e.name, &sig)?;
        if params.len() != e.params.len() {
            return Err(format!(
                "{}: the host build sees {} parameters, the PTX {}",
                e.name,
                params.len(),
                e.params.len()
            ));
        }
        kernels.push(Kernel {
            name: e.name.clone(),
            run: entry.run,
            params,
            sizes: e.params.clone(),
            static_shared: e.static_shared,
        });
    }
    let _ = name;
    Ok(Arc::new(Program { ptx, kernels }))
}

pub fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e as *const c_char)
                .to_string_lossy()
                .into_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_declarations_are_rewritten_in_place() {
        let src = "__global__ void k() {\n  __shared__ float s[32];\n  extern __shared__ float smem[];\n  __shared__ int x;\n}\n";
        let out = rewrite_shared(src).unwrap();
        assert_eq!(out.lines().count(), src.lines().count());
        assert!(out.contains("float (&s)[32] = *reinterpret_cast<float (*)[32]>"));
        assert!(out.contains("float* smem = reinterpret_cast<float*>(::cuemu_shared_dynamic())"));
        assert!(out.contains("int& x = *reinterpret_cast<int*>"));
        assert!(!out.contains("__shared__"));
        assert!(!out.contains("extern float"));
    }

    #[test]
    fn unsupported_shared_forms_are_named() {
        assert!(rewrite_shared("__shared__ float a[4], b[4];").is_err());
    }
}
