//! Chat templates rendered in a child process with a memory cap: a template is a program from
//! the model's files, and one that builds a huge string (`{% set ns.s = ns.s ~ ns.s %}` forty
//! times) would have the allocator abort this process, which no error can catch. Fuel bounds
//! its instructions ([`super::chat::FUEL`]); the child's `RLIMIT_DATA` bounds its memory: past
//! it the child dies, and the parent names the template and the sample instead.
//!
//! The child is this program (`megatrain __render-chat LIMIT`, [`serve`]); one JSON line in,
//! one out: first `{"template", "specials"}`, then a conversation's messages per line, each
//! answered `{"text", "trained": [[start, end], …]}` or `{"error", "line", "template"}`.

use super::chat::{ChatError, ChatTemplate, Rendered};
use crate::{Error, Result};
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout};

/// Memory the renderer of conversations of at most `largest` bytes (JSON) may use, bytes:
/// 1 GiB plus 64 times that (real templates need kilobytes per conversation; a rendering may
/// grow to [`super::chat::output_budget`]), within half the memory available.
pub fn memory_limit(largest: usize) -> u64 {
    let want = (1u64 << 30).saturating_add(64u64.saturating_mul(largest as u64));
    let available = crate::topology::linux::mem_available().unwrap_or(8 << 30);
    want.min(available / 2).max(256 << 20)
}

/// A chat template running in a child process.
#[derive(Debug)]
pub struct ChatWorker {
    child: Child,
    to: ChildStdin,
    from: BufReader<ChildStdout>,
    limit: u64,
}

/// Why rendering in the child failed.
#[derive(Debug)]
pub enum WorkerError {
    /// The template's or the conversation's own error, as in-process rendering gives it.
    Chat(ChatError),
    /// The child died (memory cap) or could not be talked to.
    Failed(Error),
}

impl ChatWorker {
    /// Start `exe __render-chat` with `source` and `specials`, capped at `limit` bytes.
    pub fn start(
        exe: &Path,
        source: &str,
        specials: &BTreeMap<String, String>,
        limit: u64,
    ) -> Result<Self> {
        let mut child = std::process::Command::new(exe)
            .arg("__render-chat")
            .arg(limit.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| Error::io("start the chat template renderer", exe, e))?;
        let (Some(to), Some(from)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            return Err(Error::internal("chat worker", "no pipes to the child"));
        };
        let mut w = ChatWorker {
            child,
            to,
            from: BufReader::new(from),
            limit,
        };
        let hello = json!({ "template": source, "specials": specials });
        match w.exchange(&hello) {
            Ok(reply) if reply.get("error").is_none() => Ok(w),
            Ok(reply) => Err(Error::bad_input(
                "chat template",
                "",
                chat_error(&reply).to_string(),
                None,
            )),
            Err(WorkerError::Chat(e)) => {
                Err(Error::bad_input("chat template", "", e.to_string(), None))
            }
            Err(WorkerError::Failed(e)) => Err(e),
        }
    }

    fn exchange(&mut self, request: &Json) -> std::result::Result<Json, WorkerError> {
        let mut line = request.to_string();
        line.push('\n');
        let sent = self
            .to
            .write_all(line.as_bytes())
            .and_then(|()| self.to.flush());
        let mut reply = String::new();
        let got = sent.and_then(|()| self.from.read_line(&mut reply));
        match got {
            Ok(n) if n > 0 => serde_json::from_str(&reply).map_err(|e| {
                WorkerError::Failed(Error::internal("chat worker", format!("bad reply: {e}")))
            }),
            _ => Err(WorkerError::Failed(self.died())),
        }
    }

    /// The child stopped answering: why.
    fn died(&mut self) -> Error {
        use std::os::unix::process::ExitStatusExt;
        let _ = self.child.kill();
        let reason = match self.child.wait() {
            // What the allocator's abort, or the kernel's OOM killer, does at the cap.
            Ok(s) if matches!(s.signal(), Some(libc::SIGABRT | libc::SIGKILL)) => format!(
                "the template's renderer was stopped (signal {}): it needed more than its {} of memory (a template that builds strings without bound?)",
                s.signal().unwrap_or(0),
                crate::util::human_bytes(self.limit)
            ),
            Ok(s) => format!("the template's renderer stopped unexpectedly ({s})"),
            Err(e) => format!("the template's renderer cannot be waited for ({e})"),
        };
        Error::System {
            library: "chat template",
            op: "render".into(),
            reason,
            fix: None,
        }
    }

    /// Render one conversation.
    pub fn render(&mut self, messages: &[Json]) -> std::result::Result<Rendered, WorkerError> {
        let reply = self.exchange(&Json::Array(messages.to_vec()))?;
        if reply.get("error").is_some() {
            return Err(WorkerError::Chat(chat_error(&reply)));
        }
        let text = reply["text"].as_str().unwrap_or_default().to_owned();
        let trained = reply["trained"]
            .as_array()
            .map(|spans| {
                spans
                    .iter()
                    .filter_map(|s| {
                        let (a, b) = (s[0].as_u64()? as usize, s[1].as_u64()? as usize);
                        (a <= b && b <= text.len()).then_some(a..b)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Rendered { text, trained })
    }
}

impl Drop for ChatWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn chat_error(reply: &Json) -> ChatError {
    let message = reply["error"].as_str().unwrap_or("unknown").to_owned();
    if reply["template"].as_bool() == Some(true) {
        ChatError::Template {
            line: reply["line"].as_u64().map(|l| l as usize),
            message,
        }
    } else {
        ChatError::Conversation(message)
    }
}

fn error_reply(e: &ChatError) -> Json {
    match e {
        ChatError::Template { line, message } => {
            json!({ "error": message, "line": line, "template": true })
        }
        ChatError::Conversation(m) => json!({ "error": m, "template": false }),
    }
}

/// The child's side: cap this process's data at `limit` bytes, then answer requests from
/// `input` on `output` until `input` ends.
pub fn serve(limit: u64, input: impl BufRead, mut output: impl Write) -> Result<()> {
    let rl = libc::rlimit {
        rlim_cur: limit as libc::rlim_t,
        rlim_max: limit as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct we pass; it only lowers this process's own limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_DATA, &rl) } != 0 {
        return Err(Error::system(
            "libc",
            "setrlimit(RLIMIT_DATA)",
            std::io::Error::last_os_error(),
        ));
    }
    let mut template: Option<ChatTemplate> = None;
    for line in input.lines() {
        let line = line.map_err(|e| Error::io("read", "stdin", e))?;
        let request: Json = serde_json::from_str(&line)
            .map_err(|e| Error::internal("chat worker", format!("bad request: {e}")))?;
        let reply = match (&template, request) {
            (None, hello) => {
                let specials: BTreeMap<String, String> =
                    serde_json::from_value(hello["specials"].clone()).unwrap_or_default();
                match ChatTemplate::new(hello["template"].as_str().unwrap_or(""), specials) {
                    Ok(t) => {
                        template = Some(t);
                        json!({ "ready": true })
                    }
                    Err(e) => error_reply(&e),
                }
            }
            (Some(t), Json::Array(messages)) => match t.render(&messages) {
                Ok(r) => json!({
                    "text": r.text,
                    "trained": r.trained.iter().map(|s| [s.start, s.end]).collect::<Vec<_>>(),
                }),
                Err(e) => error_reply(&e),
            },
            (Some(_), _) => {
                error_reply(&ChatError::Conversation("`messages` is not a list".into()))
            }
        };
        let mut text = reply.to_string();
        text.push('\n');
        output
            .write_all(text.as_bytes())
            .and_then(|()| output.flush())
            .map_err(|e| Error::io("write", "stdout", e))?;
    }
    Ok(())
}
