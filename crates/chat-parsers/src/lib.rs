//! Parsers of chat answers, whole and streamed.
//!
//! - [`tool_call`]: the tool-call formats of SGLang's `--tool-call-parser`
//!   (Qwen, Llama 3, Mistral, Qwen3-Coder, DeepSeek, Kimi, GLM, gpt-oss,
//!   pythonic): calls and the content around them.
//! - [`reasoning`]: the reasoning formats of SGLang's `--reasoning-parser`:
//!   the thinking part and the answer.
//!
//! Every parser has a streaming form that takes the answer in pieces and
//! gives out only what is certain. Invariant: the streamed pieces add up to
//! the result of parsing the whole text at once, for any split into pieces.
//! Parsers never panic on input; what they cannot read stays text.

mod harmony;
pub mod reasoning;
mod text;
pub mod tool_call;
