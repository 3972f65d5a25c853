//! Chat-template ids equal HF `apply_chat_template` for the real Qwen3 tokenizer
//! (fixtures from testdata/generate_fixtures.py).

use std::path::Path;

use conrub_qwen3::{ChatMessage, ChatOptions, Qwen3Tokenizer};

#[test]
fn chat_template_ids_equal_transformers() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata");
    let tok = Qwen3Tokenizer::from_dir(&data.join("qwen3-tokenizer")).unwrap();
    let cases: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(data.join("chat_template_cases.json")).unwrap()).unwrap();
    assert_eq!(cases.len(), 24);
    let mut with_think_block = 0;
    for case in &cases {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let opts = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            enable_thinking: case["enable_thinking"].as_bool(),
        };
        let label = format!("{} gen={} thinking={:?}", case["name"], opts.add_generation_prompt, opts.enable_thinking);
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
    assert_eq!(tok.decode(&[151644, 872, 198], false).unwrap(), "<|im_start|>user\n");
}
