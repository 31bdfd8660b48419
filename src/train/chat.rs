//! Chat templates: a Hugging Face tokenizer's Jinja `chat_template`, rendered with minijinja the
//! way transformers' `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, loop
//! controls, Python string methods, `raise_exception`, `strftime_now`, the special tokens as
//! variables), and the part of the rendered text each assistant message trains on:
//!
//! - with `{% generation %}…{% endgeneration %}` blocks (transformers'
//!   `return_assistant_tokens_mask`): exactly the text rendered inside them;
//! - otherwise by rendering prefixes: assistant message k trains on the text that rendering the
//!   first k+1 messages adds after rendering the first k with the generation prompt (its content
//!   through its end-of-turn token).
//!
//! Spans are byte ranges of the rendered text; [`super::prepare`] maps them to tokens.

use crate::{Error, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::ops::Range;

/// Marks the start of a generation block in the rendered text (a private-use character).
const GEN_START: char = '\u{E000}';
/// Marks its end.
const GEN_END: char = '\u{E001}';
/// Stands for a message's content to find where the template puts it.
const CONTENT_MARK: char = '\u{E002}';

/// Template instructions one rendering may run (real templates use well under 10^5 per
/// conversation; 10^8 takes seconds).
pub const FUEL: u64 = 50_000_000;

/// Bytes a rendered conversation may have: 1 MiB (a system prompt, tool definitions) plus 16
/// times its messages' JSON.
pub fn output_budget(messages: &[Json]) -> usize {
    let size: usize = messages.iter().map(|m| m.to_string().len()).sum();
    (1 << 20) + 16 * size
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    has_generation: bool,
    specials: BTreeMap<String, String>,
}

/// A conversation rendered: its text and the byte ranges of it that train.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The text, as the template renders it.
    pub text: String,
    /// Byte ranges of `text` the loss covers, in order, disjoint.
    pub trained: Vec<Range<usize>>,
}

/// Why a conversation could not be rendered: the template's own error (with its line), or a
/// message the template cannot take.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// minijinja's error, with the template line when it knows it.
    #[error("the chat template failed{}: {message}", line.map_or(String::new(), |l| format!(" at line {l}")))]
    Template {
        /// Template line.
        line: Option<usize>,
        /// minijinja's message (with `raise_exception`'s text).
        message: String,
    },
    /// A problem with the conversation itself.
    #[error("{0}")]
    Conversation(String),
}

impl From<minijinja::Error> for ChatError {
    fn from(e: minijinja::Error) -> Self {
        let message = match (e.kind(), e.detail()) {
            (minijinja::ErrorKind::OutOfFuel, _) => format!(
                "it ran {FUEL} instructions without finishing (a loop that does not end, or far too much work per conversation)"
            ),
            (kind, Some(d)) => format!("{kind}: {d}"),
            (kind, None) => kind.to_string(),
        };
        ChatError::Template {
            line: e.line(),
            message,
        }
    }
}

impl ChatTemplate {
    /// Compile `source`; `specials` are the tokenizer's special tokens by name (`bos_token`,
    /// `eos_token`, …), visible to the template as variables.
    pub fn new(source: &str, specials: BTreeMap<String, String>) -> Result<Self, ChatError> {
        let (source, has_generation) = rewrite_generation_blocks(source);
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // A template that loops without end runs out of fuel: an error naming its line.
        env.set_fuel(Some(FUEL));
        env.add_template_owned("chat_template", source)?;
        Ok(ChatTemplate {
            env,
            has_generation,
            specials,
        })
    }

    /// Whether the template marks the assistant's text with generation blocks.
    pub fn has_generation_blocks(&self) -> bool {
        self.has_generation
    }

    /// The template's output for `messages`, generation markers left in.
    fn render_marked(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let mut ctx: BTreeMap<String, minijinja::Value> = self
            .specials
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from(v.as_str())))
            .collect();
        ctx.insert(
            "messages".into(),
            minijinja::Value::from_serialize(messages),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            minijinja::Value::from(add_generation_prompt),
        );
        let tmpl = self.env.get_template("chat_template")?;
        let text = tmpl.render(ctx)?;
        let budget = output_budget(messages);
        if text.len() > budget {
            return Err(ChatError::Template {
                line: None,
                message: format!(
                    "it rendered {} for a conversation of {} messages, more than the {} a conversation's text may grow to (a template that repeats text without bound?)",
                    crate::util::human_bytes(text.len() as u64),
                    messages.len(),
                    crate::util::human_bytes(budget as u64)
                ),
            });
        }
        Ok(text)
    }

    /// The text a model continues for `messages`: the template with `add_generation_prompt`
    /// (transformers' `apply_chat_template(messages, add_generation_prompt=True)`).
    pub fn render_prompt(&self, messages: &[Json]) -> Result<String, ChatError> {
        let text = self.render_marked(messages, true)?;
        Ok(strip_markers(&text).text)
    }

    /// Render `messages` (HF chat format: objects with `role` and `content`) and find the text
    /// the assistant messages train on.
    pub fn render(&self, messages: &[Json]) -> Result<Rendered, ChatError> {
        let text = self.render_marked(messages, false)?;
        if self.has_generation {
            return Ok(strip_markers(&text));
        }
        let mut trained = Vec::new();
        for (k, m) in messages.iter().enumerate() {
            if m.get("role").and_then(Json::as_str) != Some("assistant") {
                continue;
            }
            let through = self.render_marked(&messages[..=k], false)?;
            let before = match self.render_marked(&messages[..k], true) {
                Ok(b) => b,
                // A conversation that opens with the assistant: many templates cannot render
                // no messages at all (Qwen2.5 reads `messages[0]`). The message's text is then
                // found in its own rendering, where the content starts: located by rendering
                // the message once more with a marker for its content (searching for the
                // content itself could match inside the template's own text).
                Err(_) if k == 0 => {
                    let mut marked = m.clone();
                    marked["content"] = Json::String(CONTENT_MARK.to_string());
                    let probe = self.render_marked(std::slice::from_ref(&marked), false)?;
                    match probe.find(CONTENT_MARK) {
                        Some(at) if through.starts_with(&probe[..at]) => probe[..at].to_owned(),
                        _ => {
                            return Err(ChatError::Conversation(
                                "the chat template cannot render the conversation before its first (assistant) message, nor show where that message's text starts; use a template with {% generation %} blocks, or --train-on all".into(),
                            ))
                        }
                    }
                }
                Err(e) => return Err(e),
            };
            if !through.starts_with(&before) || !text.starts_with(&through) {
                return Err(ChatError::Conversation(format!(
                    "the chat template renders message {k} (assistant) differently once later messages follow, so its text cannot be found by rendering prefixes; use a template with {{% generation %}} blocks, or --train-on all"
                )));
            }
            if through.len() > before.len() {
                trained.push(before.len()..through.len());
            }
        }
        Ok(Rendered { text, trained })
    }
}

/// Turn `{% generation %}` / `{% endgeneration %}` (transformers' extension tags, which minijinja
/// does not know) into `{% if true %}{{ MARKER }}{% endif %}`, carrying the tag's whitespace
/// control over to the two block tags, so `trim_blocks` and `lstrip_blocks` treat the text around
/// it exactly as around the original tag, and the output gains only [`GEN_START`] /
/// [`GEN_END`]. Returns the new source and whether any tag was found. (A tag spelled inside a
/// string literal, comment or raw block is rewritten too; no real template does that.)
fn rewrite_generation_blocks(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        match generation_tag(rest) {
            Some((len, name, left, right)) => {
                found = true;
                let marker = if name == "generation" {
                    GEN_START
                } else {
                    GEN_END
                };
                let (l, r) = (left.unwrap_or(' '), right.unwrap_or(' '));
                out.push_str(&format!(
                    "{{%{l} if true %}}{{{{ \"{marker}\" }}}}{{% endif {r}%}}"
                ));
                rest = &rest[len..];
            }
            None => {
                out.push_str("{%");
                rest = &rest[2..];
            }
        }
    }
    out.push_str(rest);
    (out, found)
}

/// If `s` starts with a `{% generation %}` or `{% endgeneration %}` tag: its length, its name and
/// its whitespace-control characters (left, right).
fn generation_tag(s: &str) -> Option<(usize, &'static str, Option<char>, Option<char>)> {
    let end = 2 + s.get(2..)?.find("%}")?;
    let inner = &s[2..end];
    let (left, inner) = match inner.chars().next() {
        Some(c @ ('-' | '+')) => (Some(c), &inner[1..]),
        _ => (None, inner),
    };
    let (right, inner) = match inner.chars().last() {
        Some(c @ ('-' | '+')) => (Some(c), &inner[..inner.len() - 1]),
        _ => (None, inner),
    };
    let name = match inner.trim() {
        "generation" => "generation",
        "endgeneration" => "endgeneration",
        _ => return None,
    };
    Some((end + 2, name, left, right))
}

/// Remove the generation markers from rendered text; the text between each pair trains.
fn strip_markers(marked: &str) -> Rendered {
    let mut text = String::with_capacity(marked.len());
    let mut trained: Vec<Range<usize>> = Vec::new();
    let mut open: Option<usize> = None;
    for c in marked.chars() {
        match c {
            GEN_START => open = open.or(Some(text.len())),
            GEN_END => {
                if let Some(s) = open.take() {
                    if text.len() > s {
                        trained.push(s..text.len());
                    }
                }
            }
            _ => text.push(c),
        }
    }
    if let Some(s) = open.filter(|&s| text.len() > s) {
        trained.push(s..text.len());
    }
    Rendered { text, trained }
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> std::result::Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

/// `strftime_now(format)`: the local time formatted by the C library's `strftime`, as Python's
/// `datetime.now().strftime` (which calls it) does.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let bad =
        |why: &str| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, why.to_owned());
    let fmt = std::ffi::CString::new(format).map_err(|_| bad("strftime_now: NUL in the format"))?;
    let mut buf = vec![0u8; 512];
    // SAFETY: `time(NULL)` only returns the clock; `localtime_r` writes into our `tm`;
    // `strftime` writes at most `buf.len()` bytes into `buf` and returns how many (0 when the
    // result does not fit), from a NUL-terminated format.
    let n = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(bad("strftime_now: no local time"));
        }
        libc::strftime(buf.as_mut_ptr().cast(), buf.len(), fmt.as_ptr(), &tm)
    };
    buf.truncate(n);
    String::from_utf8(buf).map_err(|_| bad("strftime_now: not UTF-8"))
}

/// Check one conversation's shape: a list of objects with a known `role` (system, user,
/// assistant, tool) and string `content`, none holding the generation markers.
pub fn check_messages(messages: &Json) -> Result<&[Json], ChatError> {
    let list = messages
        .as_array()
        .ok_or_else(|| ChatError::Conversation("`messages` is not a list".into()))?;
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .ok_or_else(|| ChatError::Conversation(format!("message {i} has no `role`")))?;
        match role.as_str() {
            Some("system" | "user" | "assistant" | "tool") => {}
            _ => {
                return Err(ChatError::Conversation(format!(
                    "message {i} has role {role}; known roles are system, user, assistant and tool"
                )))
            }
        }
        // A string, or null (an assistant message that only calls tools).
        let content = match m.get("content") {
            Some(Json::String(s)) => s.as_str(),
            Some(Json::Null) => "",
            _ => {
                return Err(ChatError::Conversation(format!(
                    "message {i} has no `content` string (or null)"
                )))
            }
        };
        if content.contains([GEN_START, GEN_END, CONTENT_MARK]) {
            return Err(ChatError::Conversation(format!(
                "message {i} contains U+E000, U+E001 or U+E002, which megatrain reserves to mark the rendered text"
            )));
        }
    }
    Ok(list)
}

/// Read a model's chat template: `chat_template.jinja` in `dir`, else `tokenizer_config.json`'s
/// `chat_template` (a string, or a list of named templates: the one named `default`).
pub fn load_template(dir: &std::path::Path, config: Option<&Json>) -> Result<Option<String>> {
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        return std::fs::read_to_string(&file)
            .map(Some)
            .map_err(|e| Error::io("read chat template", &file, e));
    }
    let Some(t) = config.and_then(|c| c.get("chat_template")) else {
        return Ok(None);
    };
    match t {
        Json::String(s) => Ok(Some(s.clone())),
        Json::Array(list) => Ok(list
            .iter()
            .find(|e| e.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|e| e.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned)),
        _ => Err(Error::bad_input(
            "tokenizer_config.json",
            dir.join("tokenizer_config.json").display().to_string(),
            "`chat_template` is neither a string nor a list of named templates",
            None,
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specials() -> BTreeMap<String, String> {
        [("bos_token", "<s>"), ("eos_token", "</s>")]
            .into_iter()
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .collect()
    }

    fn msgs(v: &str) -> Vec<Json> {
        serde_json::from_str(v).unwrap()
    }

    /// The text inside generation blocks, marked `<G>…</G>`.
    fn marked(template: &str) -> String {
        let t = ChatTemplate::new(template, specials()).unwrap();
        let r = t.render(&[]).unwrap();
        let mut out = String::new();
        let mut at = 0;
        for s in &r.trained {
            out.push_str(&r.text[at..s.start]);
            out.push_str(&format!("<G>{}</G>", &r.text[s.clone()]));
            at = s.end;
        }
        out.push_str(&r.text[at..]);
        out
    }

    #[test]
    fn generation_tags_keep_the_whitespace_rules_of_block_tags() {
        // Each as transformers renders it (jinja2 with trim_blocks and lstrip_blocks, its
        // AssistantTracker extension for the generation tags: `_render_with_assistant_indices`).
        for (template, want) in [
            (
                "{% if true %}\n  {% generation %}\n  {% if true %}X{% endif %}\n  {% endgeneration %}\n  {% endif %}\nY",
                "<G>X</G>Y",
            ),
            ("a\n  {% generation %}\nx{%- endgeneration -%}  b", "a\n<G>x</G>b"),
            (
                "{% generation %}p{% endgeneration %}  {% generation %}q{% endgeneration %}",
                "<G>p</G>  <G>q</G>",
            ),
            ("x\n\t{%- generation %}\n  y{% endgeneration +%}\nz", "x<G>  y</G>\nz"),
            ("{%+ generation +%}\nz\n{% endgeneration %}", "<G>\nz\n</G>"),
            ("{{ '{%}' }}{% generation %}w{% endgeneration %}", "{%}<G>w</G>"),
        ] {
            assert_eq!(marked(template), want, "{template:?}");
        }
        assert!(!rewrite_generation_blocks("{% generations %}").1);
        assert!(generation_tag("{%}").is_none());
    }

    #[test]
    fn generation_blocks_and_prefixes_find_the_assistant_text() {
        let conv = msgs(
            r#"[{"role":"user","content":"hi"},{"role":"assistant","content":"yo"},
                {"role":"user","content":"bye"},{"role":"assistant","content":"ok"}]"#,
        );
        let with_blocks = "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}[A]{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}\n{% else %}[U]{{ m.content }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}";
        let t = ChatTemplate::new(with_blocks, specials()).unwrap();
        assert!(t.has_generation_blocks());
        let r = t.render(&conv).unwrap();
        // trim_blocks: the newline after `{% endgeneration %}` goes, as in Jinja.
        assert_eq!(r.text, "<s>[U]hi\n[A]yo</s>[U]bye\n[A]ok</s>");
        let parts: Vec<&str> = r.trained.iter().map(|s| &r.text[s.clone()]).collect();
        assert_eq!(parts, vec!["yo</s>", "ok</s>"]);
        // The same template without the blocks: prefixes give content, end of turn and newline.
        let plain = with_blocks
            .replace("{% generation %}", "")
            .replace("{% endgeneration %}", "");
        let t = ChatTemplate::new(&plain, specials()).unwrap();
        let r = t.render(&conv).unwrap();
        let parts: Vec<&str> = r.trained.iter().map(|s| &r.text[s.clone()]).collect();
        assert_eq!(parts, vec!["yo</s>\n", "ok</s>\n"]);
    }

    #[test]
    fn template_errors_and_bad_messages_are_named() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n{% if m.role == 'system' %}{{ raise_exception('no system here') }}{% endif %}{% endfor %}",
            specials(),
        )
        .unwrap();
        let e = t
            .render(&msgs(r#"[{"role":"system","content":"x"}]"#))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no system here") && e.contains("line 2"), "{e}");
        let e = ChatTemplate::new("{% for %}", specials())
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1"), "{e}");
        let v: Json = serde_json::from_str(r#"[{"role":"robot","content":"x"}]"#).unwrap();
        let e = check_messages(&v).unwrap_err().to_string();
        assert!(e.contains("\"robot\""), "{e}");
        let v: Json = serde_json::from_str(r#"[{"role":"user"}]"#).unwrap();
        assert!(check_messages(&v)
            .unwrap_err()
            .to_string()
            .contains("content"));
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", specials()).unwrap();
        assert_eq!(t.render(&[]).unwrap().text.len(), 4);
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel_naming_its_line() {
        let t = ChatTemplate::new(
            "x\n{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}",
            specials(),
        )
        .unwrap();
        let started = std::time::Instant::now();
        let e = t.render(&[]).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("instructions"), "{e}");
        assert!(started.elapsed().as_secs() < 60);
    }

    #[test]
    fn a_conversation_opening_with_the_assistant_trains_its_text() {
        // Like Qwen2.5's: no messages at all cannot be rendered.
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'system' %}[S]sys\n{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}</s>\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
            specials(),
        )
        .unwrap();
        assert!(t.render(&[]).is_err());
        let r = t
            .render(&msgs(
                r#"[{"role":"assistant","content":"Hello!"},{"role":"user","content":"hi"},{"role":"assistant","content":"ok"}]"#,
            ))
            .unwrap();
        let parts: Vec<&str> = r.trained.iter().map(|s| &r.text[s.clone()]).collect();
        assert_eq!(parts, vec!["Hello!</s>\n", "ok</s>\n"]);
        // A reply that also occurs in the template's own text ("s" of "</s>").
        let r = t
            .render(&msgs(r#"[{"role":"assistant","content":"s"}]"#))
            .unwrap();
        let parts: Vec<&str> = r.trained.iter().map(|s| &r.text[s.clone()]).collect();
        assert_eq!(parts, vec!["s</s>\n"]);
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content.strip().upper() }}{% if m.content.startswith(' ') %}!{% endif %}{% endfor %}",
            specials(),
        )
        .unwrap();
        let r = t
            .render(&msgs(r#"[{"role":"user","content":"  hey "}]"#))
            .unwrap();
        assert_eq!(r.text, "HEY!");
    }
}
