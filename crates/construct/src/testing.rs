//! Scripted generator and reviewer servers for loopback tests and the bench.
//!
//! A test prompt carries a plan inside its question text:
//!
//! ```text
//! [[plan
//! A: t1 t2 t3:no a1        topics generator A proposes (`:no` tags it beyond the reference,
//! B: t1 t2+ t3             `+` makes its text the longest of the cluster)
//! C: t1 t2 t3 n1           topics starting with `n` come out as "does not mention" negatives
//! B!: garbage-once         generator behaviours: garbage-once, slow-once, malformed, fail, few
//! review: C=6 B=contradiction    review scores (default 9) or a contradiction verdict
//! group: unknown-ids garbage-once  grouping behaviours
//! audit: t2=drop t3=rewrite t4=manual_review t5=rewrite>t1 refuse   audit decisions (default keep)
//! dims: t1=safety          audit dimensions (default diagnosis)
//! ]]
//! ```
//!
//! Generators write "The response {verb} fact {topic} about this case." with the verbs `notes`
//! (A), `states` (B) and `explains` (C), so the reviewer can tell samples apart and cluster by
//! topic. A blind audit (after a refusal) cannot see the plan and keeps everything as `other`.

use std::collections::HashMap;

use conrub_judge::testing::{Reply, ScriptRequest, ScriptedServer};
use serde_json::{json, Value};

use crate::config::BuildConfig;
use crate::prompts::{ConstructPrompts, NO_REFERENCE};

/// The plan's lines by key (`A`, `B!`, `review`, ...).
fn plan(text: &str) -> HashMap<String, Vec<String>> {
    let mut out = HashMap::new();
    if let Some(i) = text.find("[[plan") {
        let body = &text[i + 6..];
        let body = &body[..body.find("]]").unwrap_or(body.len())];
        for line in body.lines() {
            if let Some((k, v)) = line.split_once(':') {
                if !k.trim().is_empty() && !k.contains(' ') {
                    out.insert(
                        k.trim().to_string(),
                        v.split_whitespace().map(str::to_string).collect(),
                    );
                }
            }
        }
    }
    out
}

fn verb(letter: char) -> &'static str {
    match letter {
        'A' => "notes",
        'B' => "states",
        _ => "explains",
    }
}

fn letter_of_verb(v: &str) -> Option<char> {
    match v {
        "notes" => Some('A'),
        "states" => Some('B'),
        "explains" => Some('C'),
        _ => None,
    }
}

/// The text generator `letter` writes for a topic token (`t3`, `t3:no`, `t2+`).
pub fn topic_text(letter: char, token: &str) -> String {
    let name = token.split([':', '+']).next().unwrap_or(token);
    let plus = if token.contains('+') {
        " in clear words"
    } else {
        ""
    };
    if name.starts_with('n') {
        format!("The response does not mention fact {name} about this case.")
    } else {
        format!(
            "The response {} fact {name} about this case{plus}.",
            verb(letter)
        )
    }
}

/// The topic named in a criterion text ("... fact t3 about ...").
fn topic_in(text: &str) -> Option<String> {
    let i = text.find("fact ")? + 5;
    Some(text[i..].split_whitespace().next()?.to_string())
}

fn between<'a>(t: &'a str, a: &str, b: &str) -> Option<&'a str> {
    let i = t.find(a)? + a.len();
    let j = t[i..].find(b)? + i;
    Some(&t[i..j])
}

fn has(p: &HashMap<String, Vec<String>>, key: &str, v: &str) -> bool {
    p.get(key).is_some_and(|l| l.iter().any(|x| x == v))
}

/// The answer of generator `letter`.
pub fn generator_answer(letter: char, r: &ScriptRequest, slow_ms: u64) -> Reply {
    let p = plan(&r.user);
    let bang = format!("{letter}!");
    let with_reference =
        between(&r.user, "REFERENCE ANSWER:\n<<<\n", "\n>>>").is_some_and(|t| t != NO_REFERENCE);
    if has(&p, &bang, "fail") {
        return Reply::Status(500, "generator down".into());
    }
    if has(&p, &bang, "garbage-once") && r.attempt == 1 {
        return Reply::Text(
            "Here are some thoughts on what a good answer should cover, in prose.".into(),
        );
    }
    let mut topics: Vec<String> = p.get(&letter.to_string()).cloned().unwrap_or_default();
    if has(&p, &bang, "few") {
        topics.truncate(2);
    }
    let mut items: Vec<Value> = topics
        .iter()
        .map(|t| {
            let cov = if !with_reference {
                Value::Null
            } else if t.contains(":no") {
                json!("no")
            } else {
                json!("yes")
            };
            json!({"text": topic_text(letter, t), "coverage": cov})
        })
        .collect();
    if has(&p, &bang, "malformed") {
        let cov = if with_reference {
            json!("yes")
        } else {
            Value::Null
        };
        items.push(json!({"text": "", "coverage": cov}));
        items.push(json!({"text": "Mentions fact zz about this case.", "coverage": cov}));
        items.push(json!({"text": "The response is fine.", "coverage": cov}));
        if let Some(first) = topics.first() {
            items.push(json!({"text": topic_text(letter, first).to_uppercase().replace("THE RESPONSE", "The response"), "coverage": cov}));
        }
        items.push(json!({"coverage": cov}));
    }
    let reply = Reply::Text(format!("```json\n{}\n```", json!({"criteria": items})));
    if has(&p, &bang, "slow-once") && r.attempt == 1 {
        return Reply::Sleep(slow_ms, Box::new(reply));
    }
    reply
}

/// The reviewer's answer to a review, grouping or audit request.
pub fn reviewer_answer(prompts: &ConstructPrompts, r: &ScriptRequest) -> Reply {
    let p = plan(&r.user);
    if r.system == prompts.review.system {
        let first = between(&r.user, "):\n1. ", "\n")
            .or_else(|| r.user.split("):\n1. ").nth(1))
            .unwrap_or("");
        let letter = first
            .split_whitespace()
            .nth(2)
            .and_then(letter_of_verb)
            .unwrap_or('?');
        let mut score = 9;
        let mut verdict = "consistent";
        for tok in p.get("review").into_iter().flatten() {
            if let Some((l, v)) = tok.split_once('=') {
                if l.starts_with(letter) {
                    match v {
                        "contradiction" => verdict = "contradiction",
                        s => score = s.parse().unwrap_or(score),
                    }
                }
            }
        }
        return Reply::Text(
            json!({"verdict": verdict, "score": score, "problems": []}).to_string(),
        );
    }
    if r.system == prompts.group.system {
        if has(&p, "group", "garbage-once") && r.attempt == 1 {
            return Reply::Text("These criteria mostly say similar things.".into());
        }
        let mut order: Vec<String> = Vec::new();
        let mut groups: HashMap<String, Vec<String>> = HashMap::new();
        for line in r.user.lines() {
            let Some((id, text)) = line.split_once(": ") else {
                continue;
            };
            if id.len() < 2
                || !id.starts_with(['A', 'B', 'C'])
                || !id[1..].chars().all(|c| c.is_ascii_digit())
            {
                continue;
            }
            let Some(topic) = topic_in(text) else {
                continue;
            };
            if !groups.contains_key(&topic) {
                order.push(topic.clone());
            }
            groups.entry(topic).or_default().push(id.to_string());
        }
        let mut out: Vec<Vec<String>> = order.iter().map(|t| groups[t].clone()).collect();
        if has(&p, "group", "unknown-ids") && !out.is_empty() {
            out[0].push("Z9".into());
            let again = out[0][0].clone();
            out.push(vec![again]);
        }
        return Reply::Text(json!({"groups": out}).to_string());
    }
    if r.system.starts_with(&prompts.audit.system[..60]) {
        let blind = !r.user.contains("QUESTION:");
        if !blind && has(&p, "audit", "refuse") {
            return Reply::Text(
                "I'm sorry, but I can't help with assessing this medical content.".into(),
            );
        }
        let decisions: HashMap<String, String> = p
            .get("audit")
            .into_iter()
            .flatten()
            .filter_map(|t| t.split_once('='))
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let dims: HashMap<String, String> = p
            .get("dims")
            .into_iter()
            .flatten()
            .filter_map(|t| t.split_once('='))
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let mut items = Vec::new();
        for line in r.user.lines() {
            let Some((id, text)) = line.split_once(": ") else {
                continue;
            };
            if !id.starts_with('R') || !id[1..].chars().all(|c| c.is_ascii_digit()) || id.len() < 2
            {
                continue;
            }
            let topic = topic_in(text).unwrap_or_default();
            let d = decisions.get(&topic).map(String::as_str).unwrap_or("keep");
            let (decision, rewrite) = match d.split_once('>') {
                Some((dec, target)) => (dec, Some(topic_text('C', target))),
                None if d == "rewrite" => (
                    d,
                    Some(format!(
                        "The response clearly explains fact {topic} about this case."
                    )),
                ),
                None => (d, None),
            };
            let dimension = if blind {
                "other".to_string()
            } else {
                dims.get(&topic)
                    .cloned()
                    .unwrap_or_else(|| "diagnosis".into())
            };
            items.push(json!({"id": id, "category": "direct_medical_fact", "dimension": dimension, "decision": decision, "rewrite": rewrite}));
        }
        return Reply::Text(json!({"audit": items}).to_string());
    }
    Reply::Status(400, "unknown request".into())
}

/// Three scripted generators and a scripted reviewer on loopback.
pub struct BuildServers {
    /// Generators A, B, C.
    pub generators: [ScriptedServer; 3],
    /// The reviewer.
    pub reviewer: ScriptedServer,
}

impl BuildServers {
    /// Starts the four servers; `slow-once` generators sleep `slow_ms`.
    pub async fn start(slow_ms: u64) -> Self {
        let g = |l: char| ScriptedServer::with_script(move |r| generator_answer(l, r, slow_ms));
        let prompts = ConstructPrompts::default();
        Self {
            generators: [g('A').await, g('B').await, g('C').await],
            reviewer: ScriptedServer::with_script(move |r| reviewer_answer(&prompts, r)).await,
        }
    }

    /// Every server, generators first.
    pub fn all(&self) -> [&ScriptedServer; 4] {
        [
            &self.generators[0],
            &self.generators[1],
            &self.generators[2],
            &self.reviewer,
        ]
    }

    /// Requests answered by all four servers.
    pub fn answered(&self) -> usize {
        self.all().iter().map(|s| s.answered()).sum()
    }

    /// A build config for these servers (TOML) with a per-call timeout and fast retries.
    pub fn config_toml(&self, timeout_secs: f64, extra: &str) -> String {
        let mut s = String::new();
        let role = |name: &str, url: &str, model: &str| {
            format!(
                "[{name}]\nurls = [\"{url}\"]\nmodel = \"{model}\"\ntimeout_secs = {timeout_secs}\nmax_retries = 3\n\
                 backoff_base_secs = 0.01\nbackoff_max_secs = 0.05\nconcurrency = 32\n"
            )
        };
        for (l, srv) in ['A', 'B', 'C'].iter().zip(&self.generators) {
            s.push_str(&role(
                &format!("generators.{l}"),
                &srv.url,
                &format!("gen-{}", l.to_ascii_lowercase()),
            ));
        }
        s.push_str(&role("reviewer", &self.reviewer.url, "reviewer"));
        s.push_str(extra);
        s
    }

    /// The parsed config.
    pub fn config(&self, timeout_secs: f64, extra: &str) -> BuildConfig {
        BuildConfig::from_toml(
            &self.config_toml(timeout_secs, extra),
            std::path::Path::new("."),
        )
        .expect("valid test config")
    }
}
