//! What the driver reads from a module image: the PTX ISA version (a driver refuses PTX newer
//! than it can JIT), each `.entry` with its parameter sizes and static shared memory, and, for
//! a CUBIN, the architecture it was built for and its length.

#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    /// Bytes of each parameter, in order.
    pub params: Vec<usize>,
    /// Static `.shared` bytes declared in the entry.
    pub static_shared: usize,
}

#[derive(Debug, Clone)]
pub struct PtxInfo {
    pub version: (u32, u32),
    pub target: String,
    pub entries: Vec<Entry>,
}

fn type_bytes(t: &str) -> Option<usize> {
    Some(match t.trim_start_matches('.') {
        "u8" | "s8" | "b8" | "pred" => 1,
        "u16" | "s16" | "b16" | "f16" | "bf16" => 2,
        "u32" | "s32" | "b32" | "f32" => 4,
        "u64" | "s64" | "b64" | "f64" => 8,
        _ => return None,
    })
}

/// `.param .u64 name` or `.param .align 8 .b8 name[16]` (with optional `.ptr …` qualifiers).
fn param_bytes(decl: &str) -> Option<usize> {
    let toks: Vec<&str> = decl.split_whitespace().collect();
    let last = toks.last()?;
    let ty = toks.iter().rev().skip(1).find_map(|t| type_bytes(t))?;
    match (last.find('['), last.find(']')) {
        (Some(a), Some(b)) if b > a + 1 => Some(ty * last[a + 1..b].parse::<usize>().ok()?),
        _ => Some(ty),
    }
}

/// The size of a `.shared` declaration line (`.shared .align 4 .b8 name[128];`), 0 for the
/// `extern` (dynamic) form.
fn shared_bytes(line: &str) -> usize {
    let l = line.trim().trim_end_matches(';');
    if l.starts_with(".extern") {
        return 0;
    }
    param_bytes(l.trim_start_matches(".shared")).unwrap_or(0)
}

/// Parse PTX text.
pub fn parse(ptx: &str) -> Result<PtxInfo, String> {
    let mut version = None;
    let mut target = String::new();
    let mut entries = Vec::new();
    let mut lines = ptx.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix(".version") {
            let v = v.trim();
            let (a, b) = v
                .split_once('.')
                .ok_or_else(|| format!("bad .version {v}"))?;
            version = Some((
                a.trim().parse().map_err(|_| format!("bad .version {v}"))?,
                b.trim().parse().map_err(|_| format!("bad .version {v}"))?,
            ));
        } else if let Some(v) = t.strip_prefix(".target") {
            target = v.trim().split(',').next().unwrap_or("").trim().to_owned();
        } else if let Some(i) = t.find(".entry ") {
            let rest = &t[i + ".entry ".len()..];
            let name = rest.split('(').next().unwrap_or("").trim().to_owned();
            // Parameters until the closing parenthesis.
            let mut header = rest[name.len()..].to_owned();
            while !header.contains(')') {
                match lines.next() {
                    Some(l) => {
                        header.push(' ');
                        header.push_str(l.trim());
                    }
                    None => break,
                }
            }
            let inside = header
                .split_once('(')
                .map(|(_, r)| r.split(')').next().unwrap_or(""))
                .unwrap_or("");
            let params = inside
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(|p| param_bytes(p).ok_or_else(|| format!("{name}: cannot size `{p}`")))
                .collect::<Result<Vec<_>, _>>()?;
            // The body: count braces, summing its static shared declarations.
            let mut depth = 0i32;
            let mut started = false;
            let mut static_shared = 0;
            for l in lines.by_ref() {
                let s = l.trim();
                if s.starts_with(".shared") || s.starts_with(".extern .shared") {
                    static_shared += shared_bytes(s);
                }
                depth += s.matches('{').count() as i32;
                started |= s.contains('{');
                depth -= s.matches('}').count() as i32;
                if started && depth <= 0 {
                    break;
                }
            }
            entries.push(Entry {
                name,
                params,
                static_shared,
            });
        }
    }
    Ok(PtxInfo {
        version: version.ok_or("no .version directive")?,
        target,
        entries,
    })
}

/// A CUBIN (CUDA ELF, CUDA 12 or 13): its architecture (`sm_90` → 90) and its length in bytes.
pub fn cubin(image: *const u8) -> Option<(u32, usize)> {
    // SAFETY: the caller gave a module image; an ELF header is 64 bytes and we read it only
    // after checking the magic in its first 4.
    let head = unsafe { std::slice::from_raw_parts(image, 4) };
    if head != b"\x7fELF" {
        return None;
    }
    // SAFETY: an ELF64 header is 64 bytes.
    let h = unsafe { std::slice::from_raw_parts(image, 64) };
    if h[4] != 2 {
        return None;
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |b: &[u8], o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a) as usize
    };
    let flags = u32_at(h, 48);
    let (phoff, shoff) = (u64_at(h, 32), u64_at(h, 40));
    let (phentsize, phnum) = (u16_at(h, 54), u16_at(h, 56));
    let (shentsize, shnum) = (u16_at(h, 58), u16_at(h, 60));
    let mut len = (phoff + phentsize * phnum).max(shoff + shentsize * shnum);
    if shentsize >= 40 && shnum < 65536 {
        // SAFETY: the section header table is within the image the program handed over.
        let table = unsafe { std::slice::from_raw_parts(image.add(shoff), shentsize * shnum) };
        for i in 0..shnum {
            let s = &table[i * shentsize..];
            let kind = u32_at(s, 4);
            if kind != 8 {
                // SHT_NOBITS occupies no file space.
                len = len.max(u64_at(s, 24) + u64_at(s, 32));
            }
        }
    }
    // The architecture's place in e_flags: the low byte up to CUDA 12 (ELF ABI version 7), the
    // second byte from CUDA 13 (OS ABI 0x41, ABI version 8: `sm_90` is 0x06005a04).
    let sm = if h[7] == 0x41 || h[8] >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    Some((sm, len))
}
