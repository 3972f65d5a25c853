//! Chat-template ids equal HF `apply_chat_template` for the real Qwen3 tokenizer
//! (fixtures from testdata/generate_fixtures.py).

use std::path::Path;

use conrub_models::{ChatOptions, ChatTokenizer, Message};

#[test]
fn chat_template_ids_equal_transformers() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let tok = ChatTokenizer::from_dir(&data.join("qwen3-tokenizer")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(data.join("chat_template_cases.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cases.len(), 24);
    let mut with_think_block = 0;
    for case in &cases {
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let opts = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            enable_thinking: case["enable_thinking"].as_bool(),
        };
        let label = format!(
            "{} gen={} thinking={:?}",
            case["name"], opts.add_generation_prompt, opts.enable_thinking
        );
        let text = tok.render_chat(&messages, opts).unwrap();
        assert_eq!(text, case["text"].as_str().unwrap(), "{label}");
        let ids = tok.apply_chat_template(&messages, opts).unwrap();
        let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids, expected, "{label}");
        with_think_block += text.ends_with("<think>\n\n</think>\n\n") as usize;
    }
    // enable_thinking=False with a generation prompt renders the empty think block (4 cases).
    assert_eq!(with_think_block, 4);
    assert_eq!(tok.eos_id(), Some(151645));
    assert_eq!(tok.pad_id(), Some(151643));
    assert_eq!(
        tok.decode(&[151644, 872, 198], false).unwrap(),
        "<|im_start|>user\n"
    );
}

/// The chat template takes the workspace's one message type (`conrub_base::Message`, which a rubric
/// record's question also is): messages read from JSON render exactly as the fixtures do.
#[test]
fn messages_read_from_json_render_as_the_fixtures_do() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let tok = ChatTokenizer::from_dir(&data.join("qwen3-tokenizer")).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(data.join("chat_template_cases.json")).unwrap(),
    )
    .unwrap();
    let case = cases
        .iter()
        .find(|c| {
            c["name"] == "system-user"
                && c["add_generation_prompt"] == true
                && c["enable_thinking"] == false
        })
        .unwrap();
    let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
    let question: &[Message] = &messages;
    let opts = ChatOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
    };
    assert_eq!(
        tok.render_chat(question, opts).unwrap(),
        case["text"].as_str().unwrap()
    );
    let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
    assert_eq!(tok.apply_chat_template(question, opts).unwrap(), expected);
    // Messages are exactly role and content: other fields are rejected, by name.
    let e = serde_json::from_str::<Message>(r#"{"role":"user","content":"x","tool_calls":[]}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `tool_calls`"), "{e}");
}

/// The published Llama 3.1 and Qwen2.5 Instruct templates (models/testdata/templates) render and
/// encode as transformers' `apply_chat_template` does (fixtures from
/// testdata/generate_family_fixtures.py): Llama 3 through a small BPE with its special tokens,
/// Qwen2.5 through the Qwen3 tokenizer.json it shares.
#[test]
fn llama_and_qwen2_templates_equal_transformers() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let qwen2 = tempfile::tempdir().unwrap();
    for (from, to) in [
        (
            data.join("qwen3-tokenizer/tokenizer.json"),
            "tokenizer.json",
        ),
        (
            data.join("qwen2-tokenizer/tokenizer_config.json"),
            "tokenizer_config.json",
        ),
    ] {
        std::fs::copy(from, qwen2.path().join(to)).unwrap();
    }
    for (family, dir) in [
        ("llama", data.join("llama3-tokenizer")),
        ("qwen2", qwen2.path().to_path_buf()),
    ] {
        let tok = ChatTokenizer::from_dir(&dir).unwrap();
        let cases: Vec<serde_json::Value> = serde_json::from_str(
            &std::fs::read_to_string(data.join(family).join("chat_template_cases.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cases.len(), 6, "{family}");
        for case in &cases {
            let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
            let opts = ChatOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                enable_thinking: None,
            };
            let label = format!(
                "{family} {} gen={}",
                case["name"], opts.add_generation_prompt
            );
            let text = tok.render_chat(&messages, opts).unwrap();
            assert_eq!(text, case["text"].as_str().unwrap(), "{label}");
            let ids = tok.apply_chat_template(&messages, opts).unwrap();
            let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            assert_eq!(ids, expected, "{label}");
        }
        let first = cases[0]["text"].as_str().unwrap();
        match family {
            "llama" => assert!(first.starts_with("<|begin_of_text|><|start_header_id|>system")),
            _ => assert!(first.contains("You are Qwen, created by Alibaba Cloud.")),
        }
    }
}
