//! Where a policy error is in its file: `FILE:LINE:COLUMN` of the key (or
//! list item) its field path names, for the errors found after parsing
//! (an unknown class, a limit out of range, a wrong type, a misspelt
//! field), as the YAML parser already gives for syntax errors.
//!
//! The policy is read by serde_norway into a tree without positions; this
//! walks the same text once more with a YAML event parser that has them,
//! only when a file is refused, and maps each key and list item to where
//! it starts. A path that does not resolve to the end (it runs through an
//! alias, or the two parsers disagree) takes its longest prefix that
//! does; one that resolves nowhere gets no location, and the message
//! stays as it was. Aliases are not expanded: the walk is linear in the
//! text, which the size limit bounds.

use std::collections::HashMap;

use saphyr_parser::{Event, Parser};
use tenantgate::policy::error::{FieldPath, Segment};

/// A 1-based line and column (columns count characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

/// Where each key and list item of a YAML document starts.
pub struct Positions {
    at: HashMap<Vec<Segment>, Position>,
}

/// What the walk is inside of.
enum Frame {
    Map {
        path: Vec<Segment>,
        state: MapState,
    },
    Seq {
        path: Vec<Segment>,
        next: usize,
    },
    /// A mapping or list used as a mapping key: nothing in it is a path.
    Skipped,
}

enum MapState {
    Key,
    /// The key just read; its value comes next.
    Value(String),
    /// A mapping or list used as a key is being read.
    ComplexKey,
}

impl Positions {
    /// The positions of `text`'s first document (empty when the event
    /// parser refuses the text).
    pub fn of(text: &str) -> Positions {
        let mut at = HashMap::new();
        let mut stack: Vec<Frame> = Vec::new();
        let mut started = false;
        for item in Parser::new_from_str(text) {
            let Ok((event, span)) = item else { break };
            let here = Position {
                line: span.start.line(),
                column: span.start.col().saturating_add(1),
            };
            match event {
                Event::Scalar(value, ..) => match node_path(&mut stack, &mut started, Some(&value)) {
                    // A key: the entry starts there (a repeated key, the
                    // one a duplicate-key error is about, is the last).
                    Node::Key(path) => {
                        at.insert(path, here);
                    }
                    Node::Value(path) => {
                        at.entry(path).or_insert(here);
                        value_done(&mut stack);
                    }
                    Node::Unnamed => value_done(&mut stack),
                },
                Event::Alias(_) => {
                    if let Node::Value(path) = node_path(&mut stack, &mut started, None) {
                        at.entry(path).or_insert(here);
                    }
                    value_done(&mut stack);
                }
                Event::MappingStart(..) | Event::SequenceStart(..) => {
                    let is_map = matches!(event, Event::MappingStart(..));
                    let frame = match node_path(&mut stack, &mut started, None) {
                        Node::Value(path) | Node::Key(path) => {
                            at.entry(path.clone()).or_insert(here);
                            if is_map {
                                Frame::Map {
                                    path,
                                    state: MapState::Key,
                                }
                            } else {
                                Frame::Seq { path, next: 0 }
                            }
                        }
                        Node::Unnamed => Frame::Skipped,
                    };
                    stack.push(frame);
                }
                Event::MappingEnd | Event::SequenceEnd => {
                    stack.pop();
                    value_done(&mut stack);
                }
                Event::DocumentEnd => break,
                _ => {}
            }
        }
        Positions { at }
    }

    /// Where `path` is: its own key, else its longest prefix that has one.
    pub fn find(&self, path: &FieldPath) -> Option<Position> {
        let segments = path.segments();
        (0..=segments.len())
            .rev()
            .find_map(|n| segments.get(..n).and_then(|prefix| self.at.get(prefix)).copied())
    }
}

/// What the node an event starts is.
enum Node {
    /// A mapping's key (a scalar): the path of its entry.
    Key(Vec<Segment>),
    /// A value: the root, a list item, a mapping entry's value.
    Value(Vec<Segment>),
    /// Inside a mapping or list used as a key, or a second document.
    Unnamed,
}

/// The node an event starts, and the mapping's state moved past a key.
fn node_path(stack: &mut [Frame], started: &mut bool, scalar: Option<&str>) -> Node {
    let Some(top) = stack.last_mut() else {
        // The document's root.
        let first = !*started;
        *started = true;
        return if first {
            Node::Value(Vec::new())
        } else {
            Node::Unnamed
        };
    };
    match top {
        Frame::Skipped => Node::Unnamed,
        Frame::Seq { path, next } => {
            let mut child = path.clone();
            child.push(Segment::Index(*next));
            *next = next.saturating_add(1);
            Node::Value(child)
        }
        Frame::Map { path, state } => match state {
            MapState::Key => match scalar {
                Some(key) => {
                    let mut child = path.clone();
                    child.push(Segment::Key(key.to_owned()));
                    *state = MapState::Value(key.to_owned());
                    Node::Key(child)
                }
                None => {
                    *state = MapState::ComplexKey;
                    Node::Unnamed
                }
            },
            MapState::ComplexKey => Node::Unnamed,
            MapState::Value(key) => {
                let mut child = path.clone();
                child.push(Segment::Key(key.clone()));
                Node::Value(child)
            }
        },
    }
}

/// A node ended (a scalar, an alias, a closed mapping or list): the
/// mapping holding it now expects its next key, or the value of the
/// complex key just read.
fn value_done(stack: &mut [Frame]) {
    if let Some(Frame::Map { state, .. }) = stack.last_mut() {
        match state {
            MapState::Key => {}
            MapState::ComplexKey => *state = MapState::Value(String::from("?")),
            MapState::Value(_) => *state = MapState::Key,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(text: &str, path: FieldPath) -> Option<(usize, usize)> {
        Positions::of(text).find(&path).map(|p| (p.line, p.column))
    }

    #[test]
    fn keys_items_and_flow_mappings() {
        let text = "version: x\nplans:\n  free:\n    limits:\n      - rate: 1\n        per: 1s\n      - { rate: 2, per: 1m }\n";
        let limits = FieldPath::root().key("plans").key("free").key("limits");
        assert_eq!(at(text, FieldPath::root().key("version")), Some((1, 1)));
        assert_eq!(at(text, limits.index(0).key("per")), Some((6, 9)));
        assert_eq!(at(text, limits.index(1)), Some((7, 9)));
        assert_eq!(at(text, limits.index(1).key("per")), Some((7, 20)));
        // A field that is not there: the deepest step that is.
        assert_eq!(at(text, limits.index(1).key("burst")), Some((7, 9)));
    }

    #[test]
    fn quoted_keys_aliases_and_complex_keys() {
        let text = "base: &b { rate: 1 }\n\"my plan\": *b\n? [a, b]\n: 1\nafter: 2\n";
        assert_eq!(at(text, FieldPath::root().key("my plan")), Some((2, 1)));
        // Through an alias: the alias's key (the anchor's fields are elsewhere).
        assert_eq!(
            at(text, FieldPath::root().key("my plan").key("rate")),
            Some((2, 1))
        );
        assert_eq!(at(text, FieldPath::root().key("after")), Some((5, 1)));
    }

    #[test]
    fn a_repeated_key_is_found_at_its_repetition() {
        let text = "a: 1\nb: 2\na: 3\n";
        assert_eq!(at(text, FieldPath::root().key("a")), Some((3, 1)));
    }

    #[test]
    fn text_the_event_parser_refuses_keeps_what_came_before() {
        assert_eq!(at("a: 1\nb: [", FieldPath::root().key("a")), Some((1, 1)));
        assert_eq!(at("", FieldPath::root()), None);
    }
}
