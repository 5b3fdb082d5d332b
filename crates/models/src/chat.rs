//! Chat templates: Hugging Face Jinja templates rendered with minijinja.
//!
//! The template comes from `tokenizer_config.json` (`chat_template`, a string
//! or a list of named templates), from `chat_template.jinja`, or from GGUF
//! metadata. Rendering uses the same environment settings as transformers
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`,
//! `tojson`), so the prompt text equals what `apply_chat_template` produces.

use arbor_engine_core::{CoreError, Result};
use minijinja::{Environment, ErrorKind, Value as JValue, context};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChatTemplate({} bytes)", self.source.len())
    }
}

/// One chat message.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (null for assistant messages that only call tools).
    #[serde(default)]
    pub content: Option<String>,
    /// Tool calls of an assistant message, passed to the template as is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
    /// Name of the tool (tool messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Id of the tool call answered (tool messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: Some(content.to_string()),
            tool_calls: None,
            name: None,
            tool_call_id: None,
        }
    }
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> String {
    // Templates use it for "today's date"; render a fixed UTC clock reading.
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86400) as i64;
    // Civil date from days since epoch (Howard Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    fmt.replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", month)
        .replace("%b", &month[..3])
}

impl ChatTemplate {
    /// Compiles a template source.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| CoreError::load(format!("chat template does not compile: {e}")))?;
        Ok(Self {
            env,
            source: source.to_string(),
        })
    }

    /// Finds the template of a HF model folder, if any.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            return Self::from_file(&jinja).map(Some);
        }
        let cfg_path = dir.join("tokenizer_config.json");
        if !cfg_path.exists() {
            return Ok(None);
        }
        Self::from_tokenizer_config(&cfg_path)
    }

    /// A template file: Jinja text, or (`.json`) a `tokenizer_config.json`
    /// that holds one under `chat_template`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "json") {
            return Self::from_tokenizer_config(path)?.ok_or_else(|| {
                CoreError::load(format!("{}: holds no key 'chat_template'", path.display()))
            });
        }
        let s = std::fs::read_to_string(path).map_err(|e| CoreError::io(path, e))?;
        Self::new(&s).map_err(|e| CoreError::load(format!("{}: {}", path.display(), e)))
    }

    /// A built-in template by name ([`BUILTIN_TEMPLATES`]).
    pub fn named(name: &str) -> Option<Result<Self>> {
        BUILTIN_TEMPLATES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, src)| Self::new(src))
    }

    fn from_tokenizer_config(cfg_path: &Path) -> Result<Option<Self>> {
        let text = std::fs::read_to_string(cfg_path).map_err(|e| CoreError::io(cfg_path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| CoreError::load(format!("{}: invalid JSON: {e}", cfg_path.display())))?;
        match v.get("chat_template") {
            Some(Value::String(s)) => Self::new(s).map(Some),
            Some(Value::Array(list)) => {
                let pick = list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str);
                match pick {
                    Some(s) => Self::new(s).map(Some),
                    None => Err(CoreError::load(format!(
                        "{}: key 'chat_template' holds no template",
                        cfg_path.display()
                    ))),
                }
            }
            _ => Ok(None),
        }
    }

    /// Renders `messages` (and `tools` when given) into the prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        tools: Option<&Value>,
    ) -> Result<String> {
        let vars = TemplateVars {
            add_generation_prompt,
            bos_token,
            eos_token,
            tools,
            extra: None,
        };
        self.render_with(messages, &vars)
    }

    /// Renders `messages` with `vars`, whose `extra` variables (a request's
    /// `chat_template_kwargs`, such as Qwen3's `enable_thinking`) the
    /// template sees beside the standard ones. An extra variable may not
    /// take a standard one's name ([`RESERVED_TEMPLATE_VARS`]).
    pub fn render_with(&self, messages: &[ChatMessage], vars: &TemplateVars<'_>) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| CoreError::Internal(format!("chat template: {e}")))?;
        let extra = match vars.extra {
            Some(m) => {
                if let Some(k) = m
                    .keys()
                    .find(|k| RESERVED_TEMPLATE_VARS.contains(&k.as_str()))
                {
                    return Err(CoreError::invalid(format!(
                        "chat template argument '{k}' is set by the request itself"
                    )));
                }
                JValue::from_serialize(m)
            }
            None => JValue::from(()),
        };
        tmpl.render(context! {
            messages => JValue::from_serialize(messages),
            add_generation_prompt => vars.add_generation_prompt,
            bos_token => vars.bos_token.unwrap_or_default(),
            eos_token => vars.eos_token.unwrap_or_default(),
            tools => vars.tools.map(JValue::from_serialize),
            ..extra
        })
        .map_err(|e| CoreError::invalid(format!("chat template failed: {e}")))
    }
}

/// Templates `--chat-template` takes by name, from each format's published
/// definition: ChatML (`<|im_start|>role ... <|im_end|>`, as Qwen and
/// SmolLM write it), Llama 3 Instruct (Meta's header tokens, contents
/// trimmed) and Mistral Instruct (`[INST] ... [/INST]`, a system message
/// prefixed to the first user turn).
pub const BUILTIN_TEMPLATES: [(&str, &str); 3] = [
    (
        "chatml",
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    ),
    (
        "llama-3-instruct",
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
    (
        "mistral",
        "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{% set ns.system = '' %}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}",
    ),
];

/// The variables every template render sets; a request's extra arguments
/// may not take these names.
pub const RESERVED_TEMPLATE_VARS: [&str; 5] = [
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
];

/// What a chat template renders with besides the messages.
#[derive(Clone, Copy, Debug, Default)]
pub struct TemplateVars<'a> {
    pub add_generation_prompt: bool,
    pub bos_token: Option<&'a str>,
    pub eos_token: Option<&'a str>,
    pub tools: Option<&'a Value>,
    /// A request's own variables (`chat_template_kwargs`).
    pub extra: Option<&'a serde_json::Map<String, Value>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_templates_render_their_published_formats() {
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
        ];
        let render = |name: &str| {
            let vars = TemplateVars {
                add_generation_prompt: true,
                bos_token: Some("<s>"),
                eos_token: Some("</s>"),
                ..Default::default()
            };
            ChatTemplate::named(name)
                .unwrap()
                .unwrap()
                .render_with(&msgs, &vars)
                .unwrap()
        };
        assert_eq!(
            render("chatml"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render("llama-3-instruct"),
            "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(render("mistral"), "<s>[INST] Be brief.\n\nHi [/INST]");
        assert!(ChatTemplate::named("vicuna").is_none());
    }

    /// Qwen3's published template ends so: thinking is switched off per
    /// request with `chat_template_kwargs: {"enable_thinking": false}`.
    #[test]
    fn request_arguments_reach_the_template() {
        let src = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
        let t = ChatTemplate::new(src).unwrap();
        let msgs = [ChatMessage::new("user", "Hi")];
        let render = |extra: Option<serde_json::Value>| {
            let map = extra.and_then(|v| v.as_object().cloned());
            let vars = TemplateVars {
                add_generation_prompt: true,
                extra: map.as_ref(),
                ..Default::default()
            };
            t.render_with(&msgs, &vars)
        };
        let plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(render(None).unwrap(), plain);
        assert_eq!(
            render(Some(serde_json::json!({"enable_thinking": true}))).unwrap(),
            plain
        );
        assert_eq!(
            render(Some(serde_json::json!({"enable_thinking": false}))).unwrap(),
            format!("{plain}<think>\n\n</think>\n\n")
        );
        assert!(render(Some(serde_json::json!({"messages": []}))).is_err());
    }

    #[test]
    fn chatml_template_renders() {
        let src = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let t = ChatTemplate::new(src).unwrap();
        let out = t
            .render(&[ChatMessage::new("user", " Hi ")], true, None, None, None)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_exceptions() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}",
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", " ok ")], false, None, None, None)
                .unwrap(),
            "OK"
        );
        let e = t
            .render(&[ChatMessage::new("system", "x")], false, None, None, None)
            .unwrap_err();
        assert!(e.to_string().contains("first must be user"));
    }
}
