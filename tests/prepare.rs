//! `megatrain prepare --format prompt-completion|chat`: the tokens and loss masks match what
//! transformers computes (`tools/chat_fixtures.py` wrote the expected values with
//! `apply_chat_template(..., return_assistant_tokens_mask=True)` for a template with generation
//! blocks, and by rendering prefixes for Qwen2.5's real template, which has none), and every bad
//! input is a clear error naming its line, or a counted skip.

#![allow(clippy::unwrap_used)]

use megatrain::train::config::DataDtype;
use megatrain::train::documents::DocFile;
use megatrain::train::prepare::{prepare, Format, PrepareArgs, PrepareReport, TrainOn};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat")
}

fn args(tokenizer: PathBuf, input: PathBuf, out: PathBuf, format: Format) -> PrepareArgs {
    PrepareArgs {
        tokenizer,
        input,
        out,
        dtype: None,
        format,
        text_key: "text".into(),
        eos: None,
        train_on: TrainOn::Response,
        chat_template: None,
        renderer: None,
    }
}

/// The documents of a document file: (ids, mask) each.
fn read_docs(path: &Path) -> Vec<(Vec<u32>, Vec<bool>)> {
    let f = DocFile::open(path, 1 << 20).unwrap();
    (0..f.documents())
        .map(|d| {
            let r = f.range(d);
            (
                r.clone().map(|i| f.token(i)).collect(),
                r.map(|i| f.trained(i)).collect(),
            )
        })
        .collect()
}

fn check_against_transformers(template: &str) {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("chat.bin");
    let r = prepare(&args(
        fixtures().join(template),
        fixtures().join("conversations.jsonl"),
        out.clone(),
        Format::Chat,
    ))
    .unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(format!("expected_{template}.json"))).unwrap(),
    )
    .unwrap();
    let expected = expected.as_array().unwrap();
    let docs = read_docs(&out);
    assert_eq!(docs.len(), expected.len());
    assert_eq!(r.documents, expected.len());
    assert_eq!(r.dtype, DataDtype::U16);
    let mut trained = 0;
    for (i, ((ids, mask), want)) in docs.iter().zip(expected).enumerate() {
        let want_ids: Vec<u32> = want["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let want_mask: Vec<bool> = want["assistant_masks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() == 1)
            .collect();
        assert_eq!(ids, &want_ids, "{template}: conversation {i}'s tokens");
        assert_eq!(mask, &want_mask, "{template}: conversation {i}'s loss mask");
        trained += mask.iter().filter(|&&m| m).count();
    }
    assert_eq!(r.trained, trained);
}

#[test]
fn chat_masks_match_transformers_with_generation_blocks() {
    check_against_transformers("gen");
}

#[test]
fn chat_masks_match_transformers_by_prefixes_on_qwen25s_template() {
    check_against_transformers("qwen");
}

#[test]
fn train_on_all_trains_every_token_but_the_first() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("chat.bin");
    let mut a = args(
        fixtures().join("gen"),
        fixtures().join("conversations.jsonl"),
        out.clone(),
        Format::Chat,
    );
    a.train_on = TrainOn::All;
    let r = prepare(&a).unwrap();
    assert_eq!(r.trained, r.tokens - r.documents);
    for (_, mask) in read_docs(&out) {
        assert!(!mask[0] && mask[1..].iter().all(|&m| m));
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn prompt_completion_trains_the_completion_and_eos() {
    let d = tempfile::tempdir().unwrap();
    let input = write(
        d.path(),
        "pc.jsonl",
        concat!(
            r#"{"prompt": "What is 2 plus 3?", "completion": " 5."}"#,
            "\n\n",
            r#"{"prompt": "Say it:", "completion": ""}"#,
            "\n",
            r#"{"prompt": "", "completion": "7"}"#,
            "\n"
        ),
    );
    let out = d.path().join("pc.bin");
    let r: PrepareReport = prepare(&args(
        fixtures().join("gen/tokenizer.json"),
        input,
        out.clone(),
        Format::PromptCompletion,
    ))
    .unwrap();
    assert_eq!(r.documents, 2);
    assert_eq!(r.skipped.get("empty completion"), Some(&1));
    let tk = tokenizers::Tokenizer::from_file(fixtures().join("gen/tokenizer.json")).unwrap();
    let ids = |s: &str| tk.encode(s, false).unwrap().get_ids().to_vec();
    let eos = tk.token_to_id("<|im_end|>").unwrap();
    assert_eq!(
        r.eos_id,
        Some(eos),
        "the EOS comes from tokenizer_config.json"
    );
    let docs = read_docs(&out);
    let (p, c) = (ids("What is 2 plus 3?"), ids(" 5."));
    let mut want: Vec<u32> = p.clone();
    want.extend(&c);
    want.push(eos);
    assert_eq!(docs[0].0, want);
    let want_mask: Vec<bool> = (0..want.len()).map(|i| i >= p.len()).collect();
    assert_eq!(docs[0].1, want_mask);
    // No prompt: the completion's first token has nothing before it to be predicted from.
    assert_eq!(docs[1].0, [ids("7"), vec![eos]].concat());
    assert!(!docs[1].1[0]);
    assert_eq!(r.trained, c.len() + 1 + docs[1].0.len() - 1);
}

#[test]
fn bad_samples_are_named_by_line_or_counted() {
    let d = tempfile::tempdir().unwrap();
    let gen = fixtures().join("gen");
    let run = |name: &str, text: &str, format: Format| {
        let input = write(d.path(), name, text);
        prepare(&args(gen.clone(), input, d.path().join("o.bin"), format))
    };
    let ok = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#;
    let cases = [
        (
            format!("{ok}\n{{\"messages\": [\n"),
            "bad.jsonl:2",
            "not JSON",
        ),
        (
            format!("{ok}\n{{\"msgs\": []}}\n"),
            "bad.jsonl:2",
            "`messages`",
        ),
        (
            format!("{ok}\n{{\"messages\": [{{\"role\": \"robot\", \"content\": \"x\"}}]}}\n"),
            "bad.jsonl:2",
            "\"robot\"",
        ),
        (
            format!("{ok}\n{{\"messages\": [{{\"role\": \"user\"}}]}}\n"),
            "bad.jsonl:2",
            "content",
        ),
    ];
    for (text, at, why) in cases {
        let e = run("bad.jsonl", &text, Format::Chat)
            .unwrap_err()
            .to_string();
        assert!(e.contains(at) && e.contains(why), "{e}");
    }
    // A conversation with no assistant message trains nothing: counted, not written.
    let r = run(
        "skip.jsonl",
        &format!("{ok}\n{{\"messages\": [{{\"role\": \"user\", \"content\": \"x\"}}]}}\n"),
        Format::Chat,
    )
    .unwrap();
    assert_eq!(
        (r.documents, r.skipped.get("no trained token")),
        (1, Some(&1))
    );
    // A prompt-completion sample missing its completion.
    let e = run(
        "pc.jsonl",
        "{\"prompt\": \"x\"}\n",
        Format::PromptCompletion,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("pc.jsonl:1") && e.contains("`completion`"),
        "{e}"
    );
    // Nothing to train on at all is an error, with the reasons.
    let e = run(
        "empty.jsonl",
        "{\"prompt\": \"x\", \"completion\": \"\"}\n",
        Format::PromptCompletion,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("no sample to train on") && e.contains("empty completion"),
        "{e}"
    );
    // A template that fails names its line.
    let tpl = write(
        d.path(),
        "t.jinja",
        "{% for m in messages %}\n{{ raise_exception('only users here') if m.role == 'assistant' }}{% endfor %}",
    );
    let input = write(d.path(), "c.jsonl", &format!("{ok}\n"));
    let mut a = args(gen.clone(), input, d.path().join("o.bin"), Format::Chat);
    a.chat_template = Some(tpl);
    let e = prepare(&a).unwrap_err().to_string();
    assert!(
        e.contains("c.jsonl:1") && e.contains("only users here") && e.contains("line 2"),
        "{e}"
    );
    // A tokenizer without a chat template.
    let bare = d.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    std::fs::copy(gen.join("tokenizer.json"), bare.join("tokenizer.json")).unwrap();
    let input = write(d.path(), "c2.jsonl", &format!("{ok}\n"));
    let e = prepare(&args(bare, input, d.path().join("o.bin"), Format::Chat))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no chat template") && e.contains("--chat-template"),
        "{e}"
    );
}

/// Qwen2.5's template cannot render zero messages (it reads `messages[0]`), which the prefix
/// method renders before an opening assistant message; transformers renders the conversation,
/// and so does megatrain: the greeting trains, the default system prompt does not.
#[test]
fn a_conversation_opening_with_an_assistant_greeting_renders_on_qwen25s_template() {
    use megatrain::train::chat::ChatTemplate;
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let t = ChatTemplate::new(
        config["chat_template"].as_str().unwrap(),
        Default::default(),
    )
    .unwrap();
    let messages: Vec<serde_json::Value> = serde_json::from_str(
        r#"[{"role":"assistant","content":"Hello! How can I help?"},{"role":"user","content":"hi"},{"role":"assistant","content":"ok"}]"#,
    )
    .unwrap();
    let r = t.render(&messages).unwrap();
    assert!(
        r.text.starts_with("<|im_start|>system\nYou are Qwen"),
        "{}",
        r.text
    );
    let parts: Vec<&str> = r.trained.iter().map(|s| &r.text[s.clone()]).collect();
    assert_eq!(
        parts,
        vec!["Hello! How can I help?<|im_end|>\n", "ok<|im_end|>\n"]
    );
}
